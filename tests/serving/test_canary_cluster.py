"""Which Ray cluster `fuselane canary` talks to, and what it says when it cannot: one line, no
traceback, exit 2; the demo's own cluster (`LocalRay`) on 127.0.0.1 only, and nothing of it
left after its stop. Real Ray clusters, started on this machine for the test (seconds each); the
demo's whole run, a refused token and a failed deploy: test_demo.py (extended). Also: a failed
deploy's message comes down to the replica's own error."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

pytest.importorskip("ray")

import psutil

from fuselane.serving.canary import cluster
from fuselane.serving.canary.control import replica_error
from fuselane.serving.canary.demo import DEFAULT_CONFIG
from fuselane.serving.canary.local_cluster import marked
from tests import prometheus

CONFIG = str(DEFAULT_CONFIG)


def test_an_explicit_address_is_taken_as_given():
    assert cluster.choose_address("10.0.0.5:6379", None, ["127.0.0.1:1", "127.0.0.1:2"]) == (
        "10.0.0.5:6379"
    )
    # RAY_ADDRESS counts as explicit, as Ray reads it; `auto` there leaves the choice open.
    assert cluster.choose_address("auto", "10.0.0.7:6379", ["127.0.0.1:1"]) == "10.0.0.7:6379"
    assert cluster.choose_address(None, "auto", ["127.0.0.1:1"]) == "127.0.0.1:1"


def test_auto_refuses_to_guess_between_several():
    running = ["192.0.2.2:6379", "127.0.0.1:41000"]
    with pytest.raises(cluster.ClusterError) as e:
        cluster.choose_address("auto", None, running, latest="192.0.2.2:6379")
    msg = str(e.value)
    assert msg.startswith("2 Ray clusters run on this machine: 127.0.0.1:41000, ")
    assert "192.0.2.2:6379 (the last `ray start`)" in msg and "--address" in msg
    with pytest.raises(cluster.ClusterError, match="no Ray cluster runs on this machine"):
        cluster.choose_address(None, "", [])


def test_loopback_addresses():
    assert cluster.is_loopback("127.0.0.1:6379") and cluster.is_loopback("localhost:1")
    assert cluster.is_loopback("[::1]:6379")
    assert not cluster.is_loopback("192.0.2.2:6379") and not cluster.is_loopback("head:6379")


def test_connection_failures_are_one_line_with_the_fix():
    # What Ray's C++ client logs while the GCS refuses its token, then what ray.init raises.
    log = (
        "[2026-11-26 17:28:12,876 W 17710 17710] gcs_client.cc:210: Failed to get cluster ID "
        "from GCS server: Unauthenticated: RPC error: InvalidAuthToken: Authentication token "
        "is missing or incorrect\n"
    )
    refused = ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:41631")
    msg = cluster._failure("127.0.0.1:41631", refused, log)
    assert msg.startswith("the Ray cluster at 127.0.0.1:41631 refused this client's token")
    assert "RAY_AUTH_MODE=token" in msg and "~/.ray/auth_token" in msg and "\n" not in msg

    class AuthenticationError(RuntimeError):  # ray.exceptions' name
        pass

    none = AuthenticationError(
        "Token authentication is enabled but no authentication token was found"
    )
    msg = cluster._failure("10.0.0.5:6379", none, "")
    assert "wants a token and this client has none" in msg and "RAY_AUTH_MODE=token" in msg
    msg = cluster._failure("10.0.0.5:6379", ConnectionError("Timed out\nmore"), "")
    assert msg.startswith("cannot join the Ray cluster at 10.0.0.5:6379: Timed out; check")


# Serve's status message of a custom arm whose update failed (Ray 2.60, vLLM 0.32, shortened):
# the replica's traceback follows "Error:", its own exception last.
FAILED = """The deployment failed to start 3 times in a row during a rolling update. This may \
be due to a problem with its constructor, initial health check or health checks failing. The \
update is stopped and replicas of the previous version keep running until a new deploy. See \
controller logs for details. Error:
ray::ServeReplica:fuselane-canary-custom:custom.initialize_and_get_metadata() (pid=4242, \
ip=127.0.0.1, actor_id=ab12)
  File "/venv/lib/python3.11/site-packages/ray/llm/_internal/serve/engines/vllm/vllm_engine.py", \
line 310, in _prepare_engine_config
    raise RuntimeError(f"Failed to create vLLM engine config: {e}") from e
RuntimeError: Failed to create vLLM engine config: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived \
max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config.json)."""


def test_a_failed_deployment_comes_down_to_the_replicas_error():
    assert replica_error(FAILED) == (
        "The deployment failed to start 3 times in a row during a rolling update: RuntimeError: "
        "Failed to create vLLM engine config: 1 validation error for ModelConfig Value error, "
        "User-specified max_model_len (100000) is greater than the derived max_model_len "
        "(max_position_embeddings=2048.0 or model_max_length=None in model's config.json)."
    )
    assert replica_error("Deploying.") == "Deploying."


# In a fresh process, as in a worker of the demo's cluster: the setup hook, then what a Serve
# replica does to start its gRPC server for other deployments.
HOOKED_REPLICA = """
from concurrent.futures import ThreadPoolExecutor
import grpc, psutil
from fuselane.serving.canary.local_cluster import replica_servers_on_loopback
replica_servers_on_loopback()
from ray.serve._private import replica
port = replica.add_port_to_grpc_server(grpc.server(ThreadPoolExecutor(1)), "[::]:0")
print([c.laddr.ip for c in psutil.Process().net_connections("inet") if c.laddr.port == port])
"""


def test_the_setup_hook_keeps_a_replicas_grpc_server_on_loopback():
    r = subprocess.run(
        [sys.executable, "-c", HOOKED_REPLICA], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("['127.0.0.1']", "['::ffff:127.0.0.1']"), r.stdout  # not [::]


# A cluster of its own in another process, as the demo starts it (`LocalRay`), until SIGTERM.
LOCAL_CLUSTER = """
import signal, sys, time
from fuselane.serving.canary.local_cluster import LocalRay
ray_ = LocalRay()
address = ray_.start(num_cpus=1, include_dashboard=False, _metrics_export_port=int(sys.argv[1]))
print(address, ray_.run_id, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    time.sleep(900)
finally:
    ray_.stop()
"""


@dataclass
class LocalCluster:
    proc: subprocess.Popen
    address: str
    run_id: str
    metrics_port: int

    def processes(self) -> list[psutil.Process]:
        """The driver and every process the cluster started (they carry its marker)."""
        found = [psutil.Process(self.proc.pid)] if self.proc.poll() is None else []
        return found + [p for p in psutil.process_iter() if marked(p.pid, self.run_id)]


@contextmanager
def local_cluster(env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A `LocalRay` cluster in a process of its own for the block; stopped with SIGTERM."""
    metrics_port = prometheus.free_port()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOCAL_CLUSTER, str(metrics_port)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        try:
            line = proc.stdout.readline().split()
            if len(line) != 2:
                err.seek(0)
                raise AssertionError(f"no cluster (exit {proc.wait()}): {err.read()[-3000:]}")
            yield LocalCluster(proc, line[0], line[1], metrics_port)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, IP, port) of every listening socket of `procs`."""
    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue
    return out


def settled(
    cluster: LocalCluster, ports: set[int], timeout_s: float = 90.0
) -> tuple[list[psutil.Process], list[tuple[str, str, int]]]:
    """The cluster's processes and their listening sockets once `ports` listen (or the timeout
    passed): Ray starts the agent that serves the metrics export after `ray.init` returns, and
    on two busy cores that can take tens of seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = cluster.processes()
        found = listening(procs)
        if ports <= {port for _, _, port in found} or time.monotonic() > deadline:
            return procs, found
        time.sleep(0.5)


def on_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback  # ::ffff:127.0.0.1 too


def fuselane(*argv: str) -> subprocess.Popen:
    """`fuselane ARGV...` as a user types it, in a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "fuselane.serving.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
    )


# Outside CI: on a loaded 2-core machine Ray's agent that serves a cluster's metrics export
# did not start within 90 s in two runs out of three (it did within 20 s on a quiet one).
@pytest.mark.extended
def test_two_clusters_on_this_machine():
    """Two demo clusters: every server of each on 127.0.0.1; `--address auto` names both and
    stops; a named one is joined (with this machine's token, as Ray gives it to `auto`); each
    stop leaves no process and no port of its cluster."""
    with ExitStack() as stack:
        clusters = [stack.enter_context(local_cluster()) for _ in range(2)]
        procs, ports = {}, {}
        for c in clusters:
            gcs_port = int(c.address.rsplit(":", 1)[1])
            procs[c.address], found = settled(c, {gcs_port, c.metrics_port})
            ports[c.address] = {port for _, _, port in found}
            assert {gcs_port, c.metrics_port} <= ports[c.address], found
            assert [s for s in found if not on_loopback(s[1])] == [], found
        # The commands at once: each is a Python process of a few seconds on two cores.
        auto = [fuselane("canary", *argv) for argv in (["status"], ["weight", "0.5"])]
        auto.append(fuselane("canary", "deploy", CONFIG, "--remote-model"))
        named = fuselane("canary", "status", "--address", clusters[0].address)
        for cmd in auto:
            out, err = cmd.communicate(timeout=300)
            assert cmd.returncode == 2, out + err
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "Ray clusters run on this machine: " in lines[0], err
            assert all(c.address in lines[0] for c in clusters) and "--address" in lines[0]
        # Joined: what is missing is the canary, not the cluster.
        out, err = named.communicate(timeout=300)
        assert named.returncode == 2, out + err
        assert (
            "fuselane: no status from app 'fuselane-canary': RayServeException: There is no "
            "Serve instance running on this Ray cluster."
        ) in err.splitlines(), err
        assert "Traceback" not in err
    held = {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"}
    for c in clusters:
        alive = [p for p in procs[c.address] if p.is_running() and p.status() != "zombie"]
        assert alive == [] and c.processes() == [], alive
        assert not ports[c.address] & held, ports[c.address] & held

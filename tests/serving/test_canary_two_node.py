"""The canary on two Ray nodes: the custom arm's node is lost, then comes back.

A real two-node cluster on this machine, each node a `ray start` of its own (temp dir, ports,
two CPUs): the head has the resource `stock_arm` and runs the stock arm, the ingress and the
monitor (`ingress.resources`); the second node has `custom_arm` and runs the custom arm, as the
multi-node section of docs/canary.md places them. Clients (`benchmarks/soak/clients.py`) send
completions and chats, streamed and whole, over HTTP the whole time. Then every process of the
second node is killed at once (a machine lost), and later a node with the same resource joins:

- no request is lost or passes a partial answer off as complete: each is answered whole (by
  custom before the loss, by stock after), or, for a stream custom was sending at the time,
  ends with an error event and no `[DONE]`;
- the canary's status shows the custom arm down, then up again on the new node, where its
  replica is rescheduled and takes traffic again.

The rollback rules are on (`_two_node_config`): the lost node is one outage of custom, counted
once, and shorter than `rollback.max_outage_s`, so custom is not rolled back and takes traffic
again once it is back. Three engine starts (both arms, then custom on the new node) make about
seven minutes on two shared cores: an extended test, `python -m pytest -m extended
tests/serving/test_canary_two_node.py`; with `FUSELANE_TWO_NODE_OUT=FILE.json` it also writes
its figures there (`benchmarks/results/canary-two-node-cpu-*.json`). The nodes are stopped at
the end whatever happens, by killing their processes (never `ray stop`: it stops every Ray
cluster of the machine); their logs are kept when a test failed.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve.llm")
pytest.importorskip("vllm")

import httpx
import ray

from fuselane.benchmarks.soak.clients import Load, Record, Request, judge_stream, sse_data
from fuselane.serving.canary import control
from fuselane.serving.canary.app import INGRESS
from fuselane.serving.canary.config import parse_config
from fuselane.serving.canary.split import key_point

from .test_canary import _config, _free_port

# Outside CI's 20 minutes (`python -m pytest -m extended`): a cluster of its own, three
# engine starts.
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]

APP = "canary-two-node"
WEIGHT = 0.5
# Short, so that the test sees custom retried once its node is gone and taken back once it is
# up: a request weighted to custom waits at most FIRST_RESPONSE_S for a replica before stock.
FIRST_RESPONSE_S = 10.0
COOLDOWN_S = 5.0
CPUS_PER_NODE = 2  # a replica actor and its engine's bundle: one CPU each
OBJECT_STORE_BYTES = 256 * 1024**2


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(root: int) -> list[int]:
    """`root` and every process below it (Ray's workers set up sessions of their own, so a
    process group would miss them; the parent links do not)."""
    kids, out = _children(), [root]
    for pid in out:
        out += kids.get(pid, [])
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class RayNode:
    """One `ray start --block` and everything it starts."""

    name: str
    temp_dir: Path
    proc: subprocess.Popen
    resources: dict[str, float]

    @classmethod
    def start(
        cls,
        name: str,
        root: Path,
        resources: dict[str, float],
        address: str | None = None,
        env: dict[str, str] | None = None,
    ) -> "RayNode":
        temp_dir = root / name
        ports = [_free_port() for _ in range(9)]
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        cmd += ["--node-ip-address", "127.0.0.1", "--temp-dir", str(temp_dir)]
        cmd += ["--num-cpus", str(CPUS_PER_NODE), "--resources", json.dumps(resources)]
        cmd += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
        # Two nodes on one machine: every port of its own (several defaults are fixed ones).
        cmd += ["--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1])]
        cmd += ["--dashboard-agent-listen-port", str(ports[2])]
        cmd += ["--dashboard-agent-grpc-port", str(ports[3])]
        cmd += ["--runtime-env-agent-port", str(ports[4])]
        cmd += ["--metrics-export-port", str(ports[5])]
        cmd += ["--min-worker-port", "0", "--max-worker-port", "0"]
        if address is None:
            cmd += ["--head", "--port", str(ports[6]), "--include-dashboard", "false"]
            cmd += ["--dashboard-port", str(ports[7]), "--ray-client-server-port", str(ports[8])]
        else:
            cmd += ["--address", address]
        full_env = {
            **os.environ,
            # A throwaway cluster of this test: no token. A driver takes its token mode from
            # its first ray.init (another test's, in a full run); a cluster without one takes
            # drivers of either mode.
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            **(env or {}),
        }
        temp_dir.mkdir(parents=True)
        log = (root / f"{name}.log").open("w")
        proc = subprocess.Popen(
            cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return cls(name, temp_dir, proc, resources)

    def address(self, wait_s: float = 120.0) -> str:
        """The head's GCS address, as `ray start` writes it once the head is up."""
        path = self.temp_dir / "ray_current_cluster"
        _wait(lambda: path.exists() or self.proc.poll() is not None, wait_s, "the head's address")
        if self.proc.poll() is not None:
            raise RuntimeError(f"ray start --head exited: {self.log_tail()}")
        return path.read_text().strip()

    def log_tail(self) -> str:
        return (self.temp_dir.parent / f"{self.name}.log").read_text()[-3000:]

    def kill(self) -> int:
        """Every process of the node at once, with no warning (SIGKILL): the machine is gone.
        Frozen first, so that none starts another while the others die."""
        pids = _tree(self.proc.pid)
        _signal_all(pids, signal.SIGSTOP)
        pids = _tree(self.proc.pid)
        _signal_all(pids, signal.SIGKILL)
        self.proc.wait(30)
        return len(pids)

    def node_id(self) -> str:
        """This node's Ray id: the alive node with its resources."""
        ids = [
            n["NodeID"]
            for n in ray.nodes()
            if n["Alive"] and all(k in n["Resources"] for k in self.resources)
        ]
        assert len(ids) == 1, ids
        return ids[0]


@dataclass
class Cluster:
    root: Path
    address: str
    port: int
    nodes: dict[str, RayNode] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_custom_node(self, name: str) -> RayNode:
        # The worker's Serve proxy binds a port of its own: with both proxies on one address
        # and port (SO_REUSEPORT), the kernel would hand half the connections to the node
        # that is killed; on two machines each has its own address.
        env = {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(_free_port())}
        node = RayNode.start(name, self.root, {"custom_arm": 8}, self.address, env)
        self.nodes[name] = node
        return node


def _wait(
    cond: Callable[[], Any], wait_s: float, what: str | Callable[[], str], poll_s: float = 0.5
) -> Any:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"not within {wait_s:g}s: {what if isinstance(what, str) else what()}")


def _routing(records: list[Record], since: float) -> str:
    """Who answered since `since`, and the canary's word on custom: for failure messages."""
    seen = Counter((r.arm, r.failover, r.outcome) for r in records if r.sent_at > since)
    st = control.status(APP)
    return f"answers {dict(seen)}; rollback {st['rollback']}; replicas {st['replicas']}"


def _two_node_config(model: Path, port: int) -> dict[str, Any]:
    cfg = _config(model, port)
    cfg["name"] = APP
    cfg["arms"]["stock"]["placement"] = {"bundles": [{"CPU": 1, "stock_arm": 1}]}
    cfg["arms"]["custom"]["placement"] = {"bundles": [{"CPU": 1, "custom_arm": 1}]}
    cfg["ingress"] = {"resources": {"stock_arm": 0.01}}
    cfg["routing"]["weight"] = WEIGHT
    cfg["failover"] = {"first_response_timeout_s": FIRST_RESPONSE_S, "cooldown_s": COOLDOWN_S}
    # The rules stay on: a node away for minutes is one outage (counted once, however many
    # retries after a cooldown find custom still away), shorter than max_outage_s.
    return cfg


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> Iterator[Cluster]:
    from fuselane.serving.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    # Short: Ray's socket paths under it must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="fl2n-"))
    nodes: dict[str, RayNode] = {}
    failed_before = request.session.testsfailed
    try:
        nodes["head"] = RayNode.start("head", root, {"stock_arm": 8})
        c = Cluster(root, nodes["head"].address(), _free_port(), nodes)
        c.start_custom_node("custom")
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        _wait(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 120, "two nodes alive")
        control.deploy(parse_config(_two_node_config(model, c.port)), wait_s=600)
        yield c
    finally:
        _write_figures(model)
        try:
            from ray import serve

            serve.shutdown()  # this process's Serve client, for the modules after this one
        except Exception:  # noqa: BLE001 - the nodes go anyway
            pass
        ray.shutdown()
        for node in nodes.values():
            node.kill()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"the nodes' logs are kept in {root}")


FIGURES: dict[str, Any] = {}  # each test's figures, for FUSELANE_TWO_NODE_OUT


def _write_figures(model: Path) -> None:
    out = os.environ.get("FUSELANE_TWO_NODE_OUT")
    if not out or not FIGURES:
        return
    from fuselane.benchmarks.soak import report

    cfg = _two_node_config(model, 0)
    doc = {
        "schema": "fuselane-canary-two-node/1",
        "benchmark": "tests/serving/test_canary_two_node.py",
        "date": time.strftime("%Y-%m-%d"),
        "machine": report.machine(),
        "versions": report.versions(),
        "nodes": {"head": {"stock_arm": 8}, "custom": {"custom_arm": 8}, "cpus": CPUS_PER_NODE},
        "config": {k: cfg[k] for k in ("routing", "failover", "rollback")},
        "figures": FIGURES,
    }
    Path(out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def _replica_node(deployment: str) -> str:
    """The node id of the (one) replica of `deployment` in the ingress's app."""
    actors = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")
    ]
    assert len(actors) == 1, actors
    actor = ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _by(records: list[Record], **want: Any) -> list[Record]:
    return [r for r in records if all(getattr(r, k) == v for k, v in want.items())]


def _custom_session() -> str:
    """A sticky key that the weight sends to custom (its point is below the weight)."""
    return next(f"s{i}" for i in range(1000) if key_point(f"s{i}") < WEIGHT)


def test_each_arm_runs_on_its_own_node(cluster):
    head, custom = cluster.nodes["head"].node_id(), cluster.nodes["custom"].node_id()
    replicas = control.status(APP)["replicas"]
    assert replicas["stock"]["nodes"] == [head], replicas
    assert replicas["custom"]["nodes"] == [custom], replicas
    assert _replica_node(INGRESS) == head
    assert _replica_node(control.MONITOR) == head
    with Load(cluster.url, clients=2, seed=1) as load:
        _wait(lambda: {r.arm for r in load.records} >= {"stock", "custom"}, 60, "both arms")
    records = load.stop()
    assert Counter(r.outcome for r in records) == Counter(ok=len(records)), records


async def _stream_cut_by(kill: Callable[[], float], url: str) -> tuple[list[str], float, float]:
    """A long greedy stream from custom; `kill` runs after its first chunk, and returns when
    it killed. The rest of the stream is read as it comes; returns its events, when the node
    was killed and when the stream ended."""
    req = Request("completions", True, True, 0, max_tokens=480, ignore_eos=True)
    body = req.body("tiny")
    headers = {"x-session-id": _custom_session()}
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200 and r.headers["x-fuselane-arm"] == "custom"
            data = sse_data(r)
            events = [await anext(data)]
            killed_at = await asyncio.to_thread(kill)
            events += [d async for d in data]
    return events, killed_at, time.time()


def test_losing_the_custom_node_loses_no_request(cluster):
    def kill() -> float:
        assert cluster.nodes["custom"].kill() > 5  # raylet, agents, the replica, its engine
        return time.time()

    with Load(cluster.url, clients=4, seed=2) as load:
        _wait(
            lambda: (
                len(_by(load.records, arm="custom")) >= 5
                and len(_by(load.records, arm="stock")) >= 5
            ),
            90,
            "traffic on both arms",
        )
        events, killed_at, cut_at = asyncio.run(_stream_cut_by(kill, cluster.url))
        st = _wait(
            lambda: (s := control.status(APP))["replicas"]["custom"]["running"] == 0 and s,
            90,
            "the status to show custom down",
        )
        down_at = time.time()
        # Stock keeps serving while custom is away, through a cooldown and a retry of custom.
        time.sleep(COOLDOWN_S + FIRST_RESPONSE_S + 5)
    records = load.stop()

    # The stream custom was sending when its node went: cut, visibly.
    outcome, detail, _ = judge_stream("completions", events)
    assert outcome == "error" and "[DONE]" not in events, (detail, events[-3:])
    # Every request answered: whole, or (a stream cut mid-answer) with an error event.
    outcomes = Counter(r.outcome for r in records)
    assert outcomes["lost"] == 0 and outcomes["truncated"] == 0, outcomes
    for r in _by(records, outcome="error"):
        assert r.request.stream and r.arm == "custom" and r.sent_at < killed_at, r
    # After the loss, stock answers everything, whole.
    after = [r for r in records if r.sent_at > killed_at]
    assert len(after) >= 10, len(after)
    assert {(r.outcome, r.arm) for r in after} == {("ok", "stock")}, Counter(
        (r.outcome, r.arm, r.failover) for r in after
    )
    assert {r.failover for r in after} & {"unavailable", "timeout", "cooldown"}
    # The status says so (the CLI prints this table).
    assert st["replicas"]["stock"]["running"] == 1 and not st["rolled_back"], st["replicas"]
    table = control.format_status(st)
    assert "custom 0/1" in table and "DOWN" in table, table
    failovers = dict(Counter(r.failover for r in after))
    FIGURES["node_lost"] = {
        "requests": len(records),
        "outcomes": dict(outcomes),
        "sent_after_the_kill": len(after),
        "answered_whole_by_stock_after_the_kill": len(_by(after, outcome="ok", arm="stock")),
        "failovers_after_the_kill": failovers,
        "stream_cut_s_after_the_kill": round(cut_at - killed_at, 1),
        "status_down_s_after_the_kill": round(down_at - killed_at, 1),
        "rolled_back": st["rolled_back"],
    }
    print(
        f"custom node killed: stream cut {cut_at - killed_at:.1f}s later, status down "
        f"{down_at - killed_at:.1f}s later; {len(records)} requests, {len(after)} sent after "
        f"the kill, all answered whole by stock (failover: {failovers})"
    )


def test_the_custom_arm_comes_back_with_its_node(cluster):
    started = time.time()
    node = cluster.start_custom_node("custom-again")
    with Load(cluster.url, clients=2, seed=3, timeout_s=180) as load:
        node_id = _wait(lambda: node.node_id() if _alive(node) else None, 120, "the new node")
        joined_at = time.time()
        _wait(
            lambda: control.status(APP)["replicas"]["custom"]["nodes"] == [node_id],
            600,
            "the custom replica running on the new node",
            poll_s=2.0,
        )
        up_at = time.time()
        _wait(
            lambda: any(r.arm == "custom" for r in load.records if r.sent_at > up_at),
            COOLDOWN_S + FIRST_RESPONSE_S + 30,
            lambda: f"a request answered by custom again ({_routing(load.records, up_at)})",
        )
    records = load.stop()
    assert Counter(r.outcome for r in records) == Counter(ok=len(records)), Counter(
        (r.outcome, r.detail[:60]) for r in records
    )
    st = control.status(APP)
    assert not st["rolled_back"], st["rollback"]
    assert "custom 1/1 (HEALTHY)" in control.format_status(st)
    back_at = min(r.answered_at or 0 for r in records if r.arm == "custom" and r.sent_at > up_at)
    FIGURES["node_back"] = {
        "requests": len(records),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "node_joined_s": round(joined_at - started, 1),
        "custom_replica_running_s": round(up_at - started, 1),
        "first_custom_answer_s": round(back_at - started, 1),
        "rolled_back": st["rolled_back"],
        "custom_errors_counted_in_the_window": st["arms"]["custom"]["error_rate_window"],
    }
    print(
        f"custom node started again: joined {joined_at - started:.1f}s, custom replica running "
        f"{up_at - started:.1f}s, first custom answer {back_at - started:.1f}s after its start; "
        f"{len(records)} requests, all answered whole"
    )


def _alive(node: RayNode) -> bool:
    """Whether a node with `node`'s resources is alive (the lost one is not: it is dead)."""
    return any(n["Alive"] and all(k in n["Resources"] for k in node.resources) for n in ray.nodes())

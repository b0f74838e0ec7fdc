"""`fuselane demo` as a user runs it: a subprocess with its own Ray cluster, then the commands it
prints, run as other processes of this machine.

One demo runs for the module (minutes: two CPU engines, the custom one's kernels interpreted),
scraped by a real Prometheus from before it starts. Against it, in file order: what it prints
(its cluster, the commands for it, tables free of log lines, a healthy end: custom serving);
that every server of its cluster listens on 127.0.0.1 only; the printed `status` command (each
arm's build); `--address auto` with a second cluster on the machine; a refused token; a failed
update of the custom arm; a stream cut by a crash and a rollback, on the canary dashboard;
SIGTERM, after which nothing of the cluster is left. A second demo is stopped with Ctrl-C (its
process group, as a terminal sends it) while it deploys.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("ray.serve.llm")
pytest.importorskip("vllm")

import httpx
import psutil
import yaml

from fuselane.kernels.build_id import kernel_source_hash
from fuselane.serving.canary.demo import DEFAULT_CONFIG
from fuselane.serving.canary.local_cluster import MARKER_ENV, marked
from tests import prometheus
from tests.grafana import panels

from .conftest import SCRAPE_INTERVAL_S, steady_load
from .test_canary_cluster import listening, local_cluster, on_loopback

# A whole demo and then another: outside CI's run (`python -m pytest -m extended`), with time for
# two CPU engines to start on a loaded machine (the module's first test waits for the demo).
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(3000)]

FUSELANE = [sys.executable, "-m", "fuselane.serving.cli"]
APP = "fuselane-canary"  # the demo config's name
# Ray's workers hand their metrics to the export every second (Ray's default is 10 s): the
# dashboard check reads rates over seconds of traffic.
DEMO_ENV = {"RAY_metrics_report_interval_ms": "1000", "PYTHONUNBUFFERED": "1"}
ABSL_DUMP = ("SIGTERM received", "PC: @", "logging.cc")
ARMS = ("stock", "custom")
DEMO_REQUESTS = 160


def _env(**extra: str) -> dict[str, str]:
    """This machine's environment for a command typed in a fresh shell: no Ray settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return env | DEMO_ENV | extra


@dataclass
class Demo:
    proc: subprocess.Popen
    out: Path
    err: Path
    port: int
    metrics_port: int
    model: Path
    address: str = ""
    run_id: str = ""
    kernels: str = ""  # the kernel-source hash when it started: its replicas' build

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


def _start_demo(tmp: Path, model: Path, metrics_port: int, *extra: str) -> Demo:
    port = prometheus.free_port()
    out, err = tmp / "demo.out", tmp / "demo.err"
    argv = [*FUSELANE, "demo", "--model-dir", str(model), "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port), "--deploy-timeout", "1500", *extra]
    with out.open("w") as o, err.open("w") as e:
        # Its own process group: Ctrl-C in a terminal goes to the whole group.
        proc = subprocess.Popen(argv, stdout=o, stderr=e, env=_env(), start_new_session=True)
    return Demo(proc, out, err, port, metrics_port, model)


def _wait_for(demo: Demo, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, demo.stdout())
        if m:
            return m
        if demo.proc.poll() is not None:
            break
        time.sleep(1.0)
    raise AssertionError(
        f"no {pattern!r} from the demo (exit {demo.proc.poll()}):\n{demo.stdout()[-3000:]}\n"
        f"stderr:\n{demo.stderr()[-3000:]}"
    )


def _cluster_processes(demo: Demo) -> list[psutil.Process]:
    """The demo's process and every process its cluster started: its descendants, and any that
    carry its marker (an engine whose replica was killed has another parent)."""
    found = {}
    if demo.proc.poll() is None:
        top = psutil.Process(demo.proc.pid)
        found = {p.pid: p for p in [top, *top.children(recursive=True)]}
    for p in psutil.process_iter():
        if p.pid not in found and demo.run_id and marked(p.pid, demo.run_id):
            found[p.pid] = p
    return list(found.values())


def _run_id(demo: Demo) -> str:
    """The demo's marker, from the environment of the first process its cluster started."""
    child = psutil.Process(demo.proc.pid).children()[0]
    environ = Path(f"/proc/{child.pid}/environ").read_bytes()
    return re.search(rf"{MARKER_ENV}=(\w+)".encode(), environ).group(1).decode()


def _run(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FUSELANE, *args], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory, ray_metrics):
    tmp = tmp_path_factory.mktemp("demo")
    kernels = kernel_source_hash()
    # Enough requests that custom (weight 0.25) gets the rules' min_requests (20) and more:
    # 160 is 40 for custom on average, under 20 with a chance of about 1e-4.
    load = ("--requests", str(DEMO_REQUESTS), "--concurrency", "8")
    d = _start_demo(tmp, tmp / "tiny", ray_metrics.port, *load)
    d.kernels = kernels
    try:
        d.address = _wait_for(d, r"Ray cluster: (\S+)", 600).group(1)
        _wait_for(d, r"up until Ctrl-C", 2400)
        d.run_id = _run_id(d)
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(timeout=300)


def test_the_demo_prints_its_cluster_and_the_commands_for_it(demo):
    out = demo.stdout()
    assert demo.address.startswith("127.0.0.1:"), demo.address
    assert f"fuselane canary status --address {demo.address}\n" in out
    assert f"fuselane canary weight 0.5 --address {demo.address}\n" in out
    log = re.search(r"logs of Ray and vLLM in this process: (\S+)", out).group(1)
    # The tables are the demo's alone: Ray's log lines (Serve's, the raylet's) and vLLM's went
    # to the log file.
    assert "Started Serve" in Path(log).read_text()
    for text in (out, demo.stderr()):
        assert '"asctime"' not in text and "Started Serve" not in text and "(raylet)" not in text
    assert not re.search(r"^(INFO|WARNING|DEBUG) ", out, re.M)
    # A healthy CPU run: interpreted kernels are slow by construction, the latency rule is off
    # for them, and the custom arm still serves at the end. Custom answered at least the rules'
    # min_requests, so the error rule has judged it (a smaller load proves nothing).
    assert "latency rule: custom's kernels run under Triton's interpreter: off" in out
    assert "ROLLED BACK" not in out and "\nrollbacks: 0\n" in out
    table = out[out.index("per-arm latency") :]
    stock, custom = (re.search(rf"^{arm}\s+(\d+)\s+(\d+)", table, re.M) for arm in ARMS)
    min_requests = yaml.safe_load(DEFAULT_CONFIG.read_text())["rollback"]["min_requests"]
    assert int(custom.group(1)) >= min_requests, table
    assert custom.group(2) == "0" and stock.group(2) == "0", table
    assert int(stock.group(1)) + int(custom.group(1)) == DEMO_REQUESTS, table
    assert "custom  fuselane " in out and f"kernels {demo.kernels} (triton" in out


def test_everything_of_its_cluster_listens_on_loopback_only(demo):
    listening_ = listening(_cluster_processes(demo))
    ports = {port for _, _, port in listening_}
    gcs_port = int(demo.address.rsplit(":", 1)[1])
    assert {demo.port, demo.metrics_port, gcs_port} <= ports, listening_
    exposed = [(name, ip, port) for name, ip, port in listening_ if not on_loopback(ip)]
    assert not exposed, exposed


def test_the_printed_status_command_shows_each_arms_build(demo):
    r = _run("canary", "status", "--address", demo.address)
    assert r.returncode == 0, r.stderr
    assert "stock   none reported" in r.stdout
    build = re.search(r"^  custom  fuselane (\S+) kernels (\w+) \(triton", r.stdout, re.M)
    assert build and build.group(2) == demo.kernels, r.stdout
    assert "ROLLED BACK" not in r.stdout
    r = _run("canary", "weight", "0.25", "--address", demo.address)
    assert r.returncode == 0 and "custom weight 0.25" in r.stdout, r.stderr


def test_auto_refuses_to_guess_between_two_clusters(demo):
    with local_cluster(_env()) as other:
        for argv in (["status"], ["weight", "0.5"]):
            r = _run("canary", *argv)
            assert r.returncode == 2, r.stdout
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and "Ray clusters run on this machine" in lines[0], r.stderr
            assert demo.address in lines[0] and other.address in lines[0], r.stderr
            assert "--address" in lines[0]
        r = _run("canary", "status", "--address", demo.address)  # named: it works
        assert r.returncode == 0 and "custom" in r.stdout, r.stderr


def _demo_config(demo: Demo, tmp: Path, **custom_engine: object) -> Path:
    """The demo's config, as the demo deployed it, with more engine arguments for custom."""
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["model"]["source"] = str(demo.model.resolve())
    cfg["http"] = {"host": "127.0.0.1", "port": demo.port}
    cfg["arms"]["custom"]["engine"] = dict(custom_engine)
    path = tmp / "canary.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_refused_token_is_one_line(demo, tmp_path):
    config = _demo_config(demo, tmp_path)
    wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    for argv in (["deploy", str(config)], ["status"]):
        r = _run("canary", *argv, "--address", demo.address, **wrong)
        assert r.returncode == 2, r.stdout
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert f"the Ray cluster at {demo.address} refused this client's token" in lines[0]
        assert "RAY_AUTH_MODE=token" in lines[0]


def test_a_failed_update_says_why_and_keeps_the_previous_custom_arm(demo, tmp_path):
    bad = _demo_config(demo, tmp_path, max_model_len=100000)  # the tiny model takes 2048
    r = _run("canary", "deploy", str(bad), "--address", demo.address, "--timeout", "900")
    assert r.returncode == 2, r.stdout
    assert "app 'fuselane-canary-custom': " in r.stderr and "DEPLOY_FAILED" in r.stderr
    assert "custom: The deployment failed to start" in r.stderr
    assert "User-specified max_model_len (100000) is greater than" in r.stderr, r.stderr
    assert "the previous 'fuselane-canary-custom' is deployed again and running" in r.stderr
    assert "Traceback" not in r.stderr
    body = {"model": "tiny", "prompt": "the kernel", "max_tokens": 2, "temperature": 0}
    c = httpx.post(
        f"http://127.0.0.1:{demo.port}/v1/completions",
        json=body,
        headers={"x-fuselane-arm": "custom"},
        timeout=300,
        trust_env=False,
    )
    assert c.status_code == 200 and c.headers["x-fuselane-arm"] == "custom", c.text
    assert "x-fuselane-failover" not in c.headers


def _session_dir(demo: Demo) -> Path:
    for p in _cluster_processes(demo):
        for arg in p.cmdline():
            m = re.match(r"--raylet_socket_name=(.*)/sockets/raylet$", arg)
            if m:
                return Path(m.group(1))
    raise AssertionError("no raylet in the demo's cluster")


def _cut_a_custom_stream(demo: Demo) -> list[str]:
    """A long stream pinned to custom; after its first chunk the custom replica is killed."""
    body = {"model": "tiny", "prompt": "the longest answer", "temperature": 0, "stream": True}
    body |= {"max_tokens": 400, "ignore_eos": True}
    events = []
    with httpx.Client(timeout=300, trust_env=False) as c:
        url = f"http://127.0.0.1:{demo.port}/v1/completions"
        with c.stream("POST", url, json=body, headers={"x-fuselane-arm": "custom"}) as r:
            assert r.status_code == 200 and r.headers["x-fuselane-arm"] == "custom"
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            replicas = [
                p
                for p in _cluster_processes(demo)
                if p.name().startswith("ray::ServeRepli") and "custom" in " ".join(p.cmdline())
            ]
            assert replicas, "no custom replica process"
            for p in replicas:
                p.kill()
            events += [ln[6:] for ln in lines if ln.startswith("data: ")]
    return events


ROLLBACK = """
import sys
from fuselane.serving.canary.cluster import connect
connect(sys.argv[1])
from ray import serve
monitor = serve.get_deployment_handle("CanaryMonitor", app_name=sys.argv[2])
# What a custom replica whose kernels fail their numerical checks reports (engine.py).
monitor.report_kernels.remote("test-replica", "custom", 1.0, 1.0, []).result(timeout_s=60)
"""


def test_a_cut_stream_and_a_rollback_show_on_the_dashboard(demo, ray_metrics):
    assert _run("canary", "weight", "1", "--address", demo.address).returncode == 0
    events = _cut_a_custom_stream(demo)
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == 500, events[-3:]
    # Requests for custom while its replica restarts: stock answers them (failovers).
    body = {"model": "tiny", "prompt": "after the crash", "max_tokens": 2}
    for _ in range(4):
        r = httpx.post(
            f"http://127.0.0.1:{demo.port}/v1/completions", json=body, timeout=300, trust_env=False
        )
        assert r.status_code == 200 and r.headers["x-fuselane-arm"] == "stock", r.text
    r = subprocess.run(
        [sys.executable, "-c", ROLLBACK, demo.address, APP],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    build = f"/{demo.kernels}"
    r = _run("canary", "status", "--address", demo.address)
    assert "ROLLED BACK" in r.stdout and "numerical_checks" in r.stdout, r.stdout
    assert "last rollback: from custom build " in r.stdout and build in r.stdout, r.stdout
    # The log line of the monitor replica and the metric name the build.
    logs = _session_dir(demo) / "logs" / "serve"
    line = re.compile(rf"custom arm rolled back from build \S+{build}: numerical_checks")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(line.search(p.read_text()) for p in logs.glob(f"replica_{APP}_*.log")):
            break
        time.sleep(2)
    else:
        raise AssertionError(f"no {line.pattern!r} in the monitor's log under {logs}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{demo.metrics_port}/metrics", trust_env=False).text
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_fuselane_canary_rollbacks")]
        if any(build + '"' in ln and 'reason="numerical_checks"' in ln for ln in lines):
            break
        time.sleep(2)
    assert any(build + '"' in ln for ln in lines), lines
    if ray_metrics.prom is None:
        pytest.skip("no prometheus binary")
    client = httpx.Client(base_url=f"http://127.0.0.1:{demo.port}", timeout=300, trust_env=False)
    with client, steady_load(client, pause_s=1.0):
        panels.assert_panels_return_data(
            ray_metrics.prom.url,
            "demo",
            panels.load("fuselane-canary"),
            scrape_interval_s=SCRAPE_INTERVAL_S,
            timeout_s=180,
        )


def _assert_all_gone(demo: Demo, procs: list[psutil.Process], ports: set[int]) -> None:
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not _cluster_processes(demo)
    held = {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"}
    assert not ports & held, ports & held


def test_sigterm_stops_the_demo_and_everything_its_cluster_started(demo):
    procs = _cluster_processes(demo)
    assert len(procs) > 5, procs  # GCS, raylet, agents, Serve, replicas, engines
    gcs_port = int(demo.address.rsplit(":", 1)[1])
    demo.proc.send_signal(signal.SIGTERM)
    assert demo.proc.wait(timeout=300) == 0
    err = demo.stderr()
    assert not any(s in err for s in ABSL_DUMP) and "Traceback" not in err, err[-3000:]
    assert "SIGTERM: stopping ..." in demo.stdout()
    _assert_all_gone(demo, procs, {demo.port, demo.metrics_port, gcs_port})


def test_ctrl_c_while_deploying_stops_everything(tmp_path, demo):
    # After the module's demo (the fixture's SIGTERM test): one demo at a time on two cores.
    model = demo.model
    d = _start_demo(tmp_path, model, prometheus.free_port(), "--requests", "4")
    try:
        d.address = _wait_for(d, r"Ray cluster: (\S+)", 600).group(1)
        _wait_for(d, r"deploying ", 120)
        time.sleep(20)  # replicas starting
        d.run_id = _run_id(d)
        procs = _cluster_processes(d)
        os.killpg(d.proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert d.proc.wait(timeout=300) == 128 + signal.SIGINT
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    err = d.stderr()
    assert "fuselane demo: stopped by SIGINT; its Ray cluster is stopped" in err, err[-3000:]
    assert not any(s in err for s in ABSL_DUMP) and "Traceback" not in err, err[-3000:]
    gcs_port = int(d.address.rsplit(":", 1)[1])
    _assert_all_gone(d, procs, {d.port, d.metrics_port, gcs_port})

"""`fuselane demo`: the canary end to end on this machine.

Builds the tiny model (unless `--model` names a real one), starts a local Ray (every server of
it on 127.0.0.1, no dashboard; Ray's metrics agent still serves the Prometheus export, on
127.0.0.1 too), deploys the stock and custom arms behind the canary ingress, drives a short load
through it with a progress bar, and prints per-arm latency, the shadow agreement, the canary
status, each arm's build and the per-kernel metrics, with the cluster's address and the
`fuselane canary` commands for it. Then it leaves the OpenAI endpoint and the metrics endpoint
up until Ctrl-C, SIGTERM or `--duration`, and stops the cluster it started, all of it
(`local_cluster.LocalRay.stop`).

Importing Ray Serve LLM gives this process's root logger Ray's JSON handler on stderr, and
vLLM logs to stdout: both would land in the middle of the tables. Stdout and stderr therefore
go to a log file for the run (its path is the first line printed), and the demo writes to what
they were; the progress bar keeps the terminal's stderr.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .config import CanaryConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIGS / "canary-cpu-tiny.yaml"
DEFAULT_MODEL_DIR = Path(".tiny-model")
DEFAULT_APP = "fuselane-canary"  # `fuselane canary weight|status --app`'s default

# The demo's load builds its prompts from these; the soak sends them whole.
PHRASES = (
    "the kernel writes the keys",
    "a token reads the cache",
    "every request moves a new page",
    "the scheduler serves ten tokens",
    "our canary checks the logits",
    "each layer fuses every head",
    "the sampler measures the output",
    "Tell me a story.",
    "What does the sampler do?",
    "Write a short poem.",
)


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(PHRASES, 2)) for _ in range(n)]


def demo_config(args: Any) -> CanaryConfig:
    """The demo's config: the file's, with the model, port and policies from the flags."""
    from .config import check_model_path, load_config, parse_config

    base = load_config(args.config, check_paths=False).model_dump(mode="json")
    if args.model:
        base["model"]["source"] = str(Path(args.model).expanduser().resolve())
    else:
        base["model"]["source"] = str(Path(args.model_dir).resolve())
    base["http"] = {"host": "127.0.0.1", "port": args.port}  # the demo serves this machine only
    if args.weight is not None:
        base["routing"]["weight"] = args.weight
    if args.shadow_fraction is not None:
        base["shadow"]["fraction"] = args.shadow_fraction
    config = parse_config(base, f"{args.config} (with the demo's flags)")
    check_model_path(config)
    return config


def _p(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def latency_table(records: list[Any]) -> str:
    """Per-arm latency from the load generator's records (the ingress's `x-fuselane-arm`)."""
    from .router import ARM_HEADER

    rows = [f"{'arm':<8}{'requests':>9}{'failed':>8}{'TTFT p50':>10}{'e2e p50':>10}{'e2e p95':>10}"]
    for arm in ("stock", "custom"):
        recs = [r for r in records if r.headers.get(ARM_HEADER) == arm]
        ok = [r for r in recs if r.ok]
        ttft = [r.ttft_s * 1e3 for r in ok]
        e2e = [r.e2el_s * 1e3 for r in ok]
        rows.append(
            f"{arm:<8}{len(recs):>9}{len(recs) - len(ok):>8}"
            f"{_p(ttft, 50):>8.1f}ms{_p(e2e, 50):>8.1f}ms{_p(e2e, 95):>8.1f}ms"
        )
    lost = [r for r in records if not r.headers.get(ARM_HEADER)]
    if lost:
        rows.append(f"(no arm: {len(lost)} requests failed before routing: {lost[0].error})")
    return "\n".join(rows)


async def drive_load(
    base_url: str, n: int, concurrency: int, output_len: int, pin_header: str
) -> list[Any]:
    from fuselane.serving.loadgen import Endpoint, RequestSpec, make_client, run_load

    # One request pinned to each arm first: engine warm-up stays out of the latency table.
    async with make_client(timeout_s=120.0) as client:
        for arm in ("stock", "custom"):
            body = {"model": (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]}
            body |= {"prompt": "warm up", "max_tokens": 2}
            await client.post(base_url + "/v1/completions", json=body, headers={pin_header: arm})
    specs = [RequestSpec(p, output_len) for p in prompts(n)]
    result = await run_load(
        Endpoint("canary", base_url),
        specs,
        max_concurrency=concurrency,
        extra_body={"temperature": 0.0},
        request_timeout_s=120.0,
        progress=True,
    )
    return result.records


def role_resources(config: CanaryConfig) -> dict[str, float]:
    """The custom resources the arms' placement asks for (`stock_arm`, `custom_arm`, ...): the
    demo's single node advertises them all, playing every role of a multi-node layout."""
    keys = set()
    for arm in ("stock", "custom"):
        for bundle in config.arm(arm).placement.bundles:
            keys |= {k for k in bundle if k not in ("CPU", "GPU", "memory")}
    return {k: 64.0 for k in sorted(keys)}


class DemoStopped(BaseException):
    """SIGTERM or SIGINT: a BaseException, as KeyboardInterrupt, so that no `except Exception`
    on the way (the load generator's, Ray's) takes it for an error and carries on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise DemoStopped(signum)


def _on_signals(handler: Any) -> None:
    """SIGTERM and SIGINT to `handler`. Called again once Ray is up: its core installs absl's
    failure handler for SIGTERM, which prints a stack dump before exiting."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


@contextmanager
def _handling_signals() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    _on_signals(_raise_stopped)
    try:
        yield
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


@contextmanager
def _stderr_as(stream: TextIO) -> Iterator[None]:
    """`sys.stderr` is `stream` for the block (the progress bar draws on the terminal's)."""
    saved, sys.stderr = sys.stderr, stream
    try:
        yield
    finally:
        sys.stderr = saved


def commands(address: str, app: str) -> list[str]:
    """The `fuselane canary` commands for this cluster and app, as they are to be typed."""
    flags = f" --address {address}" + ("" if app == DEFAULT_APP else f" --app {app}")
    return [f"fuselane canary status{flags}", f"fuselane canary weight 0.5{flags}"]


def run_demo(args: Any, out: TextIO | None = None) -> int:
    """The demo; `out`: where its lines go (default: the terminal's stdout)."""
    fd, log = tempfile.mkstemp(prefix="fuselane-demo-", suffix=".log")
    os.close(fd)
    from .cluster import redirect_fds

    with redirect_fds(log, (1, 2)) as terminal:
        return _run(args, out or terminal[1], terminal[2], log)


def _run(args: Any, out: TextIO, err: TextIO, log: str) -> int:
    from . import cluster
    from .local_cluster import LocalRay

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    say(f"logs of Ray and vLLM in this process: {log}")
    local = LocalRay() if args.address is None else None
    with _handling_signals():
        if not args.model:
            model_dir = Path(args.model_dir)
            if not (model_dir / "config.json").is_file():
                from fuselane.serving.tiny_model import build_tiny_model

                say(f"building the tiny model in {model_dir} ...")
                build_tiny_model(model_dir)
        config = demo_config(args)
        try:
            if local is not None:
                say(f"starting Ray on 127.0.0.1 (metrics export on :{args.metrics_port}) ...")
                # Logical CPUs, not cores: two tiny CPU engines, the ingress and the monitor
                # fit on two cores but ask Ray for more than two.
                address = local.start(
                    num_cpus=args.num_cpus or max(8, os.cpu_count() or 1),
                    resources=role_resources(config),
                    include_dashboard=False,
                    _metrics_export_port=args.metrics_port,
                )
                say(f"Ray cluster: {address} (this demo's, on 127.0.0.1 only; it stops with it)")
            else:
                address = cluster.connect(args.address)
                say(f"Ray cluster: {address}")
            _on_signals(_raise_stopped)  # after Ray's core replaced the SIGTERM handler
            return _serve(args, config, address, say, err)
        finally:
            if local is not None:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C: the stop finishes
                say("stopping the Ray cluster ...")
                local.stop()


def _serve(args: Any, config: CanaryConfig, address: str, say: Any, err: TextIO) -> int:
    """Deploy, load, report, then wait (`--duration`, a signal)."""
    from . import control
    from .kernel_metrics import format_builds

    t0 = time.monotonic()
    say(f"deploying {config.name}: stock and custom arms of {config.model.source} ...")
    control.deploy(config, wait_s=args.deploy_timeout)
    say(f"deployed in {time.monotonic() - t0:.0f}s")
    base = f"http://{config.http.host}:{config.http.port}"
    with _stderr_as(err):
        records = asyncio.run(
            drive_load(
                base, args.requests, args.concurrency, args.output_len, config.routing.pin_header
            )
        )
    time.sleep(3.0)  # two report intervals of the ingress and the arms' metric bridges
    st = control.status(config.name)
    say("\nper-arm latency (this load):")
    say(latency_table(records))
    sh = st["shadow"]
    mean = sh.get("agreement_mean_window")
    say(
        f"\nshadow agreement: {sh['compared']} mirrored requests compared, "
        f"{sh['exact']} token-identical, mean agreement "
        f"{'-' if mean is None else f'{mean:.3f}'}, max |logprob diff| "
        f"{sh['max_logprob_diff']:.2e}"
    )
    say("\ncanary status (`fuselane canary status`):")
    say(control.format_status(st))
    say(format_builds(st))
    say("\nper-kernel metrics (fuselane telemetry, from the arms' engines):")
    say(control.format_kernel_metrics(st))
    say(f"\nOpenAI API: {base}/v1   (models, completions, chat/completions)")
    if args.address is None:
        say(f"metrics:    http://127.0.0.1:{args.metrics_port}/metrics   (ray_fuselane_*)")
    say(f"status:     {base}/canary/status")
    say(f"Ray:        {address}; for this cluster:")
    for line in commands(address, config.name):
        say(f"  {line}")
    if args.duration is not None and args.duration <= 0:
        return 0
    say(
        "up until Ctrl-C or SIGTERM"
        + (f" or {args.duration:g}s" if args.duration is not None else "")
    )
    deadline = math.inf if args.duration is None else time.monotonic() + args.duration
    try:
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    except DemoStopped as e:
        say(f"\n{e.name}: stopping ...")
    return 0

"""`fuselane canary deploy CONFIG | weight W | status` and `fuselane demo`.

`add_parser(subparsers)` adds both commands to the `fuselane` parser (serving/cli.py); each
sets `func`, which returns the exit code. Heavy imports (Ray, vLLM) happen in the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Nothing heavier than the standard library at import: `fuselane --help` and `fuselane check`
# must work without the `serve` extra (pydantic, PyYAML, Ray, vLLM), which the commands import.


def _unit_interval(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {v:g}")
    return v


def _fail(msg: str) -> int:
    print(f"fuselane: {msg}", file=sys.stderr)
    return 2


def _connect(address: str) -> str | None:
    """Join the cluster; None after saying why not (`cluster.ClusterError`: one line). Before
    anything imports Ray Serve LLM or vLLM: their import logs, and takes seconds."""
    from .cluster import ClusterError, connect

    try:
        return connect(address)
    except ClusterError as e:
        _fail(str(e))
        return None


def cmd_deploy(args: argparse.Namespace) -> int:
    from .config import CanaryConfigError, check_engine_args, load_config

    # The config's own checks (milliseconds), then the cluster, then vLLM's reading of the
    # engine arguments: it imports vLLM (seconds), wasted where there is no cluster to deploy to.
    try:
        config = load_config(args.config, check_paths=not args.remote_model, check_engine=False)
    except CanaryConfigError as e:
        return _fail(str(e))
    if not args.print_serve_config and _connect(args.address) is None:
        return 2
    try:
        check_engine_args(config, args.config)
    except CanaryConfigError as e:
        return _fail(str(e))
    if args.print_serve_config:
        import yaml

        from .app import serve_config

        print(yaml.safe_dump(serve_config(config), sort_keys=False))
        return 0
    from . import control

    print(f"deploying {config.name} (stock, custom, ingress) ...", flush=True)
    try:
        weight_line = control.deploy(
            config,
            wait_s=0 if args.no_wait else args.timeout,
            weight_from_file=args.weight_from_file,
        )
    except control.CanaryControlError as e:
        return _fail(str(e))
    print(weight_line)
    state = "applied" if args.no_wait else "is running"
    print(f"{config.name} {state}: http://{config.http.host}:{config.http.port}/v1")
    return 0


def cmd_weight(args: argparse.Namespace) -> int:
    if _connect(args.address) is None:
        return 2
    from . import control

    try:
        uc = control.set_weight(args.app, args.weight, args.shadow_fraction)
    except control.CanaryControlError as e:
        return _fail(str(e))
    print(
        f"{args.app}: custom weight {uc['weight']:g}, shadow fraction "
        f"{uc.get('shadow_fraction', 0):g} (epoch {uc['epoch']}; any rollback is cleared)"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if _connect(args.address) is None:
        return 2
    from . import control
    from .kernel_metrics import format_builds

    try:
        st = control.status(args.app)
    except Exception as e:  # noqa: BLE001 - no app, no cluster: say which, exit non-zero
        return _fail(f"no status from app {args.app!r}: {type(e).__name__}: {e}")
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    print(control.format_status(st))
    print(format_builds(st))
    if args.kernels:
        print()
        print(control.format_kernel_metrics(st))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    # Only the standard library before `run_demo`: importing Ray Serve LLM and vLLM logs, and
    # the demo sends this process's logs to a file first.
    from .demo import DemoStopped, run_demo

    try:
        return run_demo(args)
    except DemoStopped as e:
        print(f"fuselane demo: stopped by {e.name}; its Ray cluster is stopped", file=sys.stderr)
        return 128 + e.signum
    except Exception as e:
        from .cluster import ClusterError
        from .config import CanaryConfigError
        from .control import CanaryControlError

        if isinstance(e, (CanaryConfigError, CanaryControlError, ClusterError)):
            return _fail(str(e))
        raise


def _common(p: argparse.ArgumentParser, app: bool = True) -> None:
    p.add_argument(
        "--address",
        default="auto",
        help="Ray cluster address, HOST:PORT (default: auto, the one cluster running on this "
        "machine; where several run, say which)",
    )
    if app:
        p.add_argument("--app", default="fuselane-canary", help="the canary's Serve app name")


def _shadow_fraction(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--shadow-fraction", type=_unit_interval, default=None, metavar="F", help=help)


def add_parser(subparsers: Any) -> None:
    """Add `canary` (deploy, weight, status) and `demo` to the `fuselane` subcommands."""
    from .demo import DEFAULT_CONFIG, DEFAULT_MODEL_DIR

    canary = subparsers.add_parser(
        "canary",
        help="deploy and steer the Ray Serve canary (stock vs custom kernels)",
        description="Route traffic between vLLM replicas with stock kernels and replicas with "
        "fuselane's kernels, on a running Ray cluster (`ray start --head` first).",
    )
    sub = canary.add_subparsers(dest="canary_command", metavar="ACTION", required=True)

    d = sub.add_parser(
        "deploy",
        help="deploy (or update) the canary from a YAML config",
        description="Deploys the stock arm, the custom arm and the OpenAI ingress that CONFIG "
        "describes (YAML, validated field by field) on the running Ray cluster, or updates them "
        "in place, and waits until they are RUNNING.",
    )
    d.add_argument("config", help="canary config (see serving/configs/)")
    _common(d, app=False)
    d.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for RUNNING")
    d.add_argument("--no-wait", action="store_true", help="return once the config is applied")
    d.add_argument(
        "--weight-from-file",
        action="store_true",
        help="use the file's routing.weight and shadow.fraction on a canary already running "
        "(by default a redeploy keeps the live ones, which `fuselane canary weight` may have "
        "changed)",
    )
    d.add_argument(
        "--remote-model",
        action="store_true",
        help="model.source exists on the cluster's nodes only: do not check it here",
    )
    d.add_argument(
        "--print-serve-config",
        action="store_true",
        help="print the equivalent Serve config (for `serve deploy`) and exit: checks the "
        "config without a cluster",
    )
    d.set_defaults(func=cmd_deploy)

    w = sub.add_parser(
        "weight",
        help="set the custom arm's share of traffic, live (also clears a rollback)",
        description="Sets the custom arm's share of traffic on the running canary, without a "
        "redeploy (a session stays on its arm). Setting a weight also clears an automatic "
        "rollback.",
    )
    w.add_argument("weight", type=_unit_interval, help="0..1, e.g. 0.25")
    _shadow_fraction(w, "also set the fraction of requests sent to both arms and compared (0..1)")
    _common(w)
    w.set_defaults(func=cmd_weight)

    s = sub.add_parser(
        "status",
        help="per-arm traffic, latency, agreement and rollbacks",
        description="Per-arm requests, errors and latency, shadow agreement, rollbacks and the "
        "current weight of the running canary.",
    )
    _common(s)
    s.add_argument("--json", action="store_true", help="the raw status as JSON")
    s.add_argument("--kernels", action="store_true", help="also the per-kernel metrics")
    s.set_defaults(func=cmd_status)

    demo = subparsers.add_parser(
        "demo",
        help="build the tiny model, deploy both arms locally, drive load, show the metrics",
        description="The canary end to end on this machine: a local Ray on 127.0.0.1 only, "
        "stock and custom vLLM arms behind the canary ingress, a short load, per-arm latency, "
        "shadow agreement, builds and per-kernel metrics. Endpoints stay up until Ctrl-C, "
        "SIGTERM or --duration; then the Ray cluster it started stops, all of it.",
    )
    demo.add_argument("--config", default=str(DEFAULT_CONFIG), help="canary config YAML")
    demo.add_argument("--model", help="a real model directory (GPU); default: the tiny model")
    demo.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), help="tiny model directory")
    demo.add_argument("--port", type=int, default=8000, help="OpenAI endpoint port (127.0.0.1)")
    demo.add_argument("--metrics-port", type=int, default=8080, help="Ray metrics export port")
    demo.add_argument("--requests", type=int, default=200, help="requests in the load")
    demo.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    demo.add_argument("--output-len", type=int, default=16, help="tokens per request")
    demo.add_argument("--weight", type=_unit_interval, default=None, help="custom arm share")
    _shadow_fraction(
        demo, "fraction of requests sent to both arms and compared (default: the config's)"
    )
    demo.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="Ray's logical CPUs for the local Ray (default: max(8, the machine's cores))",
    )
    demo.add_argument(
        "--deploy-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the arms to start (default 900)",
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds to keep the endpoints up after the load (default: until Ctrl-C; 0: exit)",
    )
    demo.add_argument(
        "--address", default=None, help="use this Ray cluster instead of starting one"
    )
    demo.set_defaults(func=cmd_demo)

"""The `fuselane` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from fuselane.serving import bench_serve
from fuselane.serving.canary import cli as canary_cli
from fuselane.serving.dashboards import cli as dashboards_cli


def _cmd_check(args: argparse.Namespace) -> int:
    from fuselane.serving.selfcheck import run_selfcheck

    return run_selfcheck(families=args.family, seed=args.seed, out=sys.stdout)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from fuselane.serving.tiny_model import build_tiny_model

    path = build_tiny_model(args.dir, **({} if args.seed is None else {"seed": args.seed}))
    print(f"tiny model written to {path}")
    return 0


EPILOG = """\
Inside vLLM, an environment variable picks the kernels of each process:
  FUSELANE_KERNELS=all vllm serve MODEL
  (a comma list of attention, kv_cache, sampling; or all; default none: stock vLLM)
FUSELANE_TELEMETRY=1 adds per-kernel metrics to vLLM's /metrics.
`fuselane COMMAND --help` describes each command; the README has the walkthrough."""


def _version() -> str:
    try:
        return metadata.version("fuselane")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        return "(source checkout, not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuselane",
        description=(
            "Custom Triton kernels for vLLM serving: run them, check them against their "
            "references, canary them and measure them."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fuselane {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser(
        "check",
        help="run every kernel on a realistic batch and compare it with its torch reference",
        description=(
            "Runs each kernel family on fresh random inputs shaped like a Llama-3-8B batch and "
            "compares the result with the family's torch reference. On a machine without a GPU "
            "the kernels run under Triton's interpreter. Exits 1 if any check fails."
        ),
    )
    check.add_argument(
        "--family",
        action="append",
        metavar="NAME",
        help="only this kernel family (repeatable); default: all that are installed",
    )
    check.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    check.set_defaults(func=_cmd_check)

    tiny = sub.add_parser(
        "tiny-model",
        help="build the tiny Llama model (random weights, offline tokenizer) into a folder",
        description=(
            "Writes a 2-layer Llama-architecture model with random weights from a fixed seed and "
            "a byte-level BPE tokenizer trained offline: loadable by vLLM and transformers."
        ),
    )
    tiny.add_argument("dir", help="output folder (created; existing model files are replaced)")
    tiny.add_argument("--seed", type=int, default=None, help="weight seed (default: built-in)")
    tiny.set_defaults(func=_cmd_tiny_model)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: kernels against their peers (GPU), serving load against endpoints",
        description=(
            "Benchmarks. `bench kernels` times every kernel family against vLLM's, FlashInfer's "
            "and torch's kernels on real model shapes (GPU); `bench serve` drives "
            "OpenAI-compatible endpoints with load and compares them."
        ),
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    # `bench kernels` lives with the benchmarks (fuselane.benchmarks.kernels.cli), registered
    # under the `fuselane.bench` entry point so this package does not import them.
    for ep in metadata.entry_points(group="fuselane.bench"):
        ep.load()(bench_sub)
    bench_serve.add_parser(bench_sub)

    canary_cli.add_parser(sub)
    dashboards_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything imports the kernels: without a GPU they run under Triton's interpreter.
    from fuselane.kernels import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

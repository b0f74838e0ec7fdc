"""The `fuselane` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fuselane.serving import bench_serve
from fuselane.serving.canary import cli as canary_cli


def _cmd_check(args: argparse.Namespace) -> int:
    from fuselane.serving.selfcheck import run_selfcheck

    return run_selfcheck(families=args.family, seed=args.seed, out=sys.stdout)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from fuselane.serving.tiny_model import build_tiny_model

    path = build_tiny_model(args.dir, **({} if args.seed is None else {"seed": args.seed}))
    print(f"tiny model written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuselane",
        description=(
            "Custom Triton kernels for vLLM serving: run them, check them against their "
            "references, canary them and measure them."
        ),
    )
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
        help="benchmarks: end-to-end serving load (bench serve)",
        description="Benchmarks. `bench serve` drives OpenAI-compatible endpoints with load.",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_serve.add_parser(bench_sub)
    bench.set_defaults(func=lambda _args: _missing_subcommand(bench))

    canary_cli.add_parser(sub)
    return parser


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

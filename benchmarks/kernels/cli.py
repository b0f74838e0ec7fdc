"""`fuselane bench kernels`: every kernel family against its peers over real model shapes (GPU).

The `fuselane` command finds this through the `fuselane.bench` entry point (`add_parser`), so
the serving package never imports the benchmarks; `python -m fuselane.benchmarks.kernels.cli`
runs it directly (a source checkout on PYTHONPATH, as on a GPU machine). The parser is built
from the standard library and the grid (no torch): `fuselane --help` stays fast and works
without a GPU stack. The run itself is benchmarks/kernels/suite.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuselane.benchmarks.kernels import grid as kgrid
from fuselane.benchmarks.kernels.grid import ALL_SECTIONS, FAMILIES, MODELS, SECTIONS, SIZES

if TYPE_CHECKING:  # imported where used: the suite imports torch
    from fuselane.benchmarks.kernels.gate import GateReport
    from fuselane.benchmarks.kernels.suite import Options

PEERS = ("vllm", "flashinfer", "torch")
DEFAULT_BUDGET_S = 330.0

DESCRIPTION = f"""\
Times every kernel family of fuselane against whichever peers import here, on shapes of real
models, in one process on one GPU:
  attention   decode (B=1..256; ragged batches) and prefill of 1k to 32k tokens, each over
              bf16 and fp8 KV caches, and mixed batches (paged KV cache, page 16)
  kv_cache    paged KV writes, bf16 and fp8 quantize-on-write, and fused RoPE + write
  sampling    fused temperature / top-k / top-p sampling at the model's vocabulary
Peers: vLLM's Triton kernels (unified attention, reshape_and_cache_flash), FlashInfer (paged
decode/prefill, append_paged_kv_cache, top-k/top-p sampling), torch (SDPA, index_copy_, the
sort-based sampler vLLM falls back to).

Models, with query heads / KV heads / head size per GPU:
  {", ".join(f"{n} ({m.num_q_heads}/{m.num_kv_heads}/{m.head_size})" for n, m in MODELS.items())}.
Llama-3-70B is timed as one GPU of tensor parallel 8 sees it; Mistral-7B with its sliding
window of 4096; Gemma-2-9B with head size 256 and logit soft cap 50.

Every output is checked against the kernel's torch reference before it is timed; times are
medians of CUDA-graph replays. Written to --out: kernels-<gpu>-<date>.json (device, versions,
measured ceilings, every row: median us, TB/s or TFLOP/s, % of the ceiling, peer / fuselane),
the same as a markdown report (.md) and, with matplotlib, one PNG per family: time against
size with the roofline of the measured ceilings. The full grid takes ~28 min on an H100 (most of
it compiling and capturing; FlashInfer builds its kernels in background processes meanwhile),
past the default --budget: split it over calls with --family / --section / --model (--list
prints the cases and their estimated seconds; docs/performance.md has a split of five calls)
and join the parts with --merge.

Peers on a machine without vLLM: put vLLM's Triton kernel files and FlashInfer on PYTHONPATH
(see .peers/setup_device.sh in a checkout); a peer that does not import is listed, not fatal.
Performance gate: with --baseline FILE (a results file of an earlier run on the same GPU
model; benchmarks/results/baseline-kernels-<gpu>.json are the committed ones, --quick --peers
none), every fuselane row slower than the baseline's by more than --max-regression (and the
absolute floor --min-delta-us) is timed once more (the sections and models of those rows,
without peers; --no-confirm skips it) and, if slower again, named and the exit status is 1.
Run it before merging a kernel change. Peers, other versions and rows missing on either side
are reported, not compared (benchmarks/kernels/gate.py).
Exit status: 0, or 1 if a fuselane kernel failed its check or could not run, or a row failed
the gate; 2 on usage (a baseline of another GPU model included)."""

EPILOG = """\
examples:
  fuselane bench kernels --out results/kernels
  fuselane bench kernels --quick --family attention --model llama-3-8b --out /tmp/k
  fuselane bench kernels --interpret-smoke --out /tmp/smoke   # no GPU: plumbing check only
  fuselane bench kernels --section decode_fp8 --budget 480 --out /tmp/k   # one part of the grid
  fuselane bench kernels --list --family attention   # cases and estimated seconds, no GPU
  fuselane bench kernels --quick --peers none --out /tmp/k \
      --baseline benchmarks/results/baseline-kernels-h200.json   # the gate before a merge"""


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {value:g}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 10:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 10), got {text!r}")
    return value


def _peers(text: str) -> frozenset[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    bad = [n for n in names if n not in PEERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown peer {bad[0] if bad else text!r}: give a comma list of "
            f"{', '.join(PEERS)}, or none"
        )
    return frozenset(names)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `kernels` on the `fuselane bench` subparsers; the handler is `args.func`."""
    p = subparsers.add_parser(
        "kernels",
        help="every kernel family against vLLM's, FlashInfer's and torch's kernels (GPU)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--family",
        action="append",
        choices=FAMILIES,
        metavar="NAME",
        help=f"only this kernel family (repeatable; one of {', '.join(FAMILIES)}; default: all)",
    )
    p.add_argument(
        "--model",
        action="append",
        choices=list(MODELS),
        metavar="NAME",
        help=f"only this model's shapes (repeatable; one of {', '.join(MODELS)}; default: all)",
    )
    p.add_argument(
        "--section",
        action="append",
        choices=ALL_SECTIONS,
        metavar="NAME",
        help="only this section (repeatable; "
        + "; ".join(f"{f}: {', '.join(SECTIONS[f])}" for f in FAMILIES)
        + "; default: all of the chosen families)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="no run: join the results files of several parts of one grid (one GPU model) into "
        "one JSON, markdown report and plots in --out",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the cases this selection would run, with estimated GPU seconds, and exit "
        "(no GPU needed)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="a small grid: "
        + ", ".join(f"{s} {len(v)}" for s, v in SIZES["quick"].items())
        + " size(s) per model",
    )
    mode.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="no GPU needed: one tiny case per section under Triton's interpreter, torch peers "
        "only, every output written. A plumbing check: the timings are meaningless",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-kernels"),
        metavar="DIR",
        help="output folder, created if missing (default: ./bench-kernels)",
    )
    p.add_argument(
        "--peers",
        type=_peers,
        default=None,
        metavar="LIST",
        help=f"comma list of peers to time ({', '.join(PEERS)}) or none (default: all that "
        "import; --interpret-smoke: torch)",
    )
    p.add_argument(
        "--budget",
        type=_budget,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help="time limit: no new case after 85%% of it (the rest is for FlashInfer rows whose "
        "kernels were still compiling), what is left is listed as skipped "
        f"(default {DEFAULT_BUDGET_S:g}; 0: no limit)",
    )
    p.add_argument(
        "--gpus",
        type=_positive_int,
        default=1,
        metavar="N",
        help="spread the selection's sections over N GPUs of this host, one process per GPU "
        "(CUDA_VISIBLE_DEVICES picks which), each into --out/gpu<i>, then merge them into "
        "--out (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or case lines")
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="FILE",
        help="performance gate: compare fuselane's rows with this results file (same GPU model)",
    )
    p.add_argument(
        "--max-regression",
        type=_fraction,
        default=0.05,
        metavar="FRACTION",
        help="with --baseline: a row slower by more than this fraction fails (default 0.05)",
    )
    p.add_argument(
        "--min-delta-us",
        type=_fraction,
        default=0.2,
        metavar="US",
        help="with --baseline: and by more than this many microseconds (default 0.2: the "
        "timer's granularity on the smallest kernels)",
    )
    p.add_argument(
        "--no-confirm",
        action="store_true",
        help="with --baseline: fail on the first run's slower rows without timing them again",
    )
    p.set_defaults(func=cmd_bench_kernels)
    return p


class Progress:
    """Case progress: a tqdm bar when tqdm is installed and stderr is a terminal (row lines
    print above it), else one plain `[i/n] case` line per case, which reads well in a log."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.total = 0
        self.done = 0

    def begin(self, total: int) -> None:
        self.total = total
        if not (self.enabled and sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc="bench kernels", unit="case", file=sys.stderr)

    def case(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            if self.done > 1:
                self.bar.update(1)
            self.bar.set_postfix_str(label[:60], refresh=True)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {label}", flush=True)

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.update(self.done - self.bar.n)
            self.bar.close()
            self.bar = None


def _selection(args: argparse.Namespace) -> tuple[str, tuple[str, ...], tuple[str, ...]] | str:
    """(grid, families, sections) of the command line, or what is wrong with it. A section
    names its family, so --section alone implies it."""
    grid = "smoke" if args.interpret_smoke else "quick" if args.quick else "full"
    sections = tuple(args.section or ())
    owners = {s: f for f in FAMILIES for s in SECTIONS[f]}
    families = tuple(args.family or dict.fromkeys(owners[s] for s in sections) or FAMILIES)
    outside = [s for s in sections if owners[s] not in families]
    if outside:
        family = owners[outside[0]]
        return f"--section {outside[0]} belongs to family {family}, which --family leaves out"
    return grid, families, sections


def list_cases(
    grid: str, families: tuple[str, ...], models: tuple[str, ...], sections: tuple[str, ...]
) -> str:
    """The cases of a selection with their estimated GPU seconds, per section and in all."""
    cases = kgrid.build_grid(families, models or None, grid, sections or None)
    lines, total = [], kgrid.RUN_START_S
    for section in dict.fromkeys(c.section for c in cases):
        mine = [c for c in cases if c.section == section]
        est = sum(kgrid.estimate_s(c) for c in mine)
        total += est
        lines.append(f"{mine[0].family} {section}: {len(mine)} cases, ~{est:.0f} s")
        lines += [f"  {c.key}  ~{kgrid.estimate_s(c):.0f} s" for c in mine]
    lines.append(
        f"{len(cases)} cases, ~{total:.0f} s with every peer (estimate, H100; "
        f"+{kgrid.RUN_START_S:g} s start; FlashInfer builds run beside)"
    )
    return "\n".join(lines)


def _merge(files: list[Path], out: Path, names: list[str] | None = None) -> int:
    """Joins results files into one in `out`; `names`: how the parts are named in it (default:
    the files' names)."""
    import json

    from fuselane.benchmarks.kernels import outputs

    try:
        parts = [json.loads(f.read_text()) for f in files]
        merged = outputs.merge(parts, names or [f.name for f in files])
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"fuselane bench kernels: error: --merge: {e}\n")
        return 2
    paths = outputs.write_all(merged, out)
    print(outputs.markdown(merged))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    selection = _selection(args)
    if isinstance(selection, str):
        sys.stderr.write(f"fuselane bench kernels: error: {selection}\n")
        return 2
    grid, families, sections = selection
    if args.merge:
        return _merge(args.merge, args.out)
    if args.list:
        models = () if args.interpret_smoke else tuple(args.model or ())
        print(list_cases(grid, families, models, sections))
        if args.gpus > 1:
            from fuselane.benchmarks.kernels import multi_gpu

            planned = multi_gpu.shares(grid, families, models, sections, args.gpus)
            for i, (share, est) in enumerate(planned):
                print(f"--gpus {args.gpus}, process {i}: {', '.join(share)} (~{est:.0f} s)")
        return 0
    if args.interpret_smoke and args.model:
        sys.stderr.write(
            "fuselane bench kernels: error: --interpret-smoke runs its own tiny model (real "
            "shapes are too slow for the interpreter): drop --model\n"
        )
        return 2
    if sections and not kgrid.build_grid(families, tuple(args.model or ()) or None, grid, sections):
        sys.stderr.write(
            f"fuselane bench kernels: error: the {grid} grid has no case in section(s) "
            f"{', '.join(sections)} (the quick and smoke grids keep the gate's sections)\n"
        )
        return 2
    if args.gpus > 1:
        return _run_on_gpus(args, grid, families, sections)
    if args.interpret_smoke:
        # must precede every Triton import: @triton.jit picks interpreter or compiler there
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.interpret_smoke and not torch.cuda.is_available():
        sys.stderr.write(
            "fuselane bench kernels: error: no CUDA GPU is visible to torch "
            f"({torch.__version__}, CUDA build {torch.version.cuda or 'none'}). The benchmark "
            "times kernels on a GPU; on this machine, --interpret-smoke runs the whole pipeline "
            "under Triton's interpreter as a plumbing check (timings meaningless).\n"
        )
        return 2
    from fuselane.benchmarks.kernels import gate, suite

    baseline = None
    if args.baseline is not None:
        try:  # before the run: a wrong file should not cost a benchmark
            baseline = gate.load(args.baseline)
        except gate.GateError as e:
            sys.stderr.write(f"fuselane bench kernels: error: {e}\n")
            return 2

    peers = args.peers
    if peers is None:
        peers = frozenset({"torch"}) if args.interpret_smoke else frozenset(PEERS)
    opts = suite.Options(
        out=args.out,
        families=families,
        models=tuple(args.model or ()),
        sections=sections,
        grid=grid,
        peers=peers,
        budget_s=args.budget or None,
        seed=args.seed,
    )
    _stop_on_sigterm()
    outcome = suite.run(opts, Progress(enabled=not args.no_progress))
    print()
    print(outcome.markdown)
    print(f"wrote {', '.join(str(p) for p in outcome.paths.values())}")
    print(f"total {outcome.elapsed_s:.0f} s")
    if outcome.skipped:
        print(f"{len(outcome.skipped)} skipped (listed in the report)")
    status = 0
    if outcome.failures:
        print("fuselane failures:\n  " + "\n  ".join(outcome.failures), file=sys.stderr)
        status = 1
    if baseline is not None:
        current = gate.load(outcome.paths["json"])
        try:
            report = gate.compare(current, baseline, args.max_regression, args.min_delta_us)
            if report.regressions and not args.no_confirm:
                report = _confirm(report, current, opts)
        except gate.GateError as e:
            sys.stderr.write(f"fuselane bench kernels: error: {e}\n")
            return 2
        print(report.text())
        status = status or (0 if report.passed else 1)
    return status


def _run_on_gpus(
    args: argparse.Namespace, grid: str, families: tuple[str, ...], sections: tuple[str, ...]
) -> int:
    """--gpus N: the sections spread over N processes, one per GPU, then merged
    (benchmarks/kernels/multi_gpu.py)."""
    from fuselane.benchmarks.kernels import multi_gpu

    def error(text: str) -> int:
        sys.stderr.write(f"fuselane bench kernels: error: {text}\n")
        return 2

    if args.baseline is not None:
        return error(
            "--gpus runs no performance gate (a gate compares one GPU's run with its baseline): "
            "run --baseline without --gpus"
        )
    try:
        devices = multi_gpu.visible_devices(args.gpus)
    except ValueError as e:
        return error(str(e))
    if not args.interpret_smoke:  # the interpreter's processes need no GPU
        import torch

        count = torch.cuda.device_count()
        if count < args.gpus:
            return error(f"--gpus {args.gpus}: torch sees {count} CUDA GPU(s) on this host")
    status, files = multi_gpu.run(args, grid, families, sections, devices)
    if not files:
        return error("no part wrote its results (see the run.log of each --out/gpu<i>)")
    merged = _merge(files, args.out, [str(f.relative_to(args.out)) for f in files])
    print("parts:\n" + "\n".join(multi_gpu.part_summary(files)))
    return status or merged


def _confirm(report: GateReport, current: dict[str, Any], opts: Options) -> GateReport:
    """`report` after timing its slower rows' sections and models once more, without peers,
    into --out/confirm (`gate.confirm`)."""
    from fuselane.benchmarks.kernels import gate, suite

    sections, models = gate.rerun_selection(report, current)
    print(f"gate: {len(report.regressions)} rows slower; timing {', '.join(sections)} of "
          f"{', '.join(models)} again")  # fmt: skip
    again = suite.run(
        dataclasses.replace(opts, out=opts.out / "confirm", sections=tuple(sections),
                            models=tuple(models), peers=frozenset(), budget_s=None),
        Progress(enabled=False),
    )  # fmt: skip
    return gate.confirm(report, gate.load(again.paths["json"]))


def _stop_on_sigterm() -> None:
    """A SIGTERM (`timeout`, a job runner) ends the run with the cases done so far written, as
    a spent budget does (suite.run writes its outputs on the way out), not with nothing."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        raise SystemExit(f"fuselane bench kernels: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    """`python -m fuselane.benchmarks.kernels.cli ARGS`: the same as `fuselane bench kernels`."""
    parser = argparse.ArgumentParser(prog="fuselane bench")
    add_parser(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["kernels", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

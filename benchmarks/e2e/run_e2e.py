"""End to end on the GPU: fuselane inside vLLM 0.26 against vLLM's FLASH_ATTN and TRITON_ATTN.

One run, one lease. For each engine configuration ("arm": FLASH_ATTN, the Hopper default;
TRITON_ATTN; fuselane = `FUSELANE_KERNELS=attention,kv_cache`; fuselane_all =
`FUSELANE_KERNELS=all` once `fuselane.plugin.sampler_hook` exists) it starts, each in its own
subprocess so that GPU memory is freed between engines:

1. an offline engine (`vllm.LLM` on the Llama-3-8B config with `load_format="dummy"`,
   `skip_tokenizer_init=True`, bf16, token-id prompts drawn from a fixed seed) that runs
   - a greedy correctness pass on a fixed prompt set (token ids, top-5 logprobs of every
     generated token, and the prompt logprobs of the short prompts), compared afterwards with
     FLASH_ATTN's, and
   - the offline workloads 256 x (512 in, 256 out), 64 x (2048 in, 512 out),
     16 x (8192 in, 256 out), sampling with temperature 0.8, top_k 50, top_p 0.9 and
     ignore_eos (output tok/s, total tok/s, wall);
2. vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1) on a copy
   of the model directory that holds a generated word-level tokenizer of the model's full
   vocabulary (token `i` is the word `t<i>`: every id the dummy model emits decodes, and the
   prompts stay token ids); driven by `fuselane.serving.loadgen.run_load` at two Poisson request
   rates and summarized by `fuselane.serving.bench_serve.summarize` (TTFT / ITL / throughput).

Every engine's log is kept under `OUT/logs/` and scanned for what it says about the attention
backend, fuselane's selection, torch.compile, CUDA graph capture, fallbacks and graph breaks.
Both engines of one arm share a torch.compile cache dir (`/tmp/fuselane-e2e/compile/<arm>`), so
the second start reuses the first one's compile. An arm that fails is recorded with its error
and the run goes on; a time budget (`--budget-s`) skips what would not fit, saying so.
One JSON (device, versions, the sampler vLLM's own arms run (`stock_sampler`: read from the
installed vLLM's sources), per-arm results, ratios to FLASH_ATTN, the comparisons) goes to
`OUT/e2e_results.json` and `benchmarks/results/e2e-<device>-<date>.json`; a table is printed last.

How it runs on the device (no network there; torch 2.11 + triton 3.6 installed; vLLM 0.26 is
staged in four parts: a stripped vLLM wheel and the dependencies the machine lacks): the device
gets the repository plus the `.vllm-gpu` parts; three calls put the vLLM parts (each call
carries `.vllm-gpu/a` (then b, c) and `.vllm-gpu/device.sh`; the model configs are
committed under benchmarks/e2e/models/ and travel with the tree):

    bash .vllm-gpu/device.sh put .vllm-gpu/a
    bash .vllm-gpu/device.sh put .vllm-gpu/b
    bash .vllm-gpu/device.sh put .vllm-gpu/c

then one call (carrying `.vllm-gpu/d` and `.vllm-gpu/device.sh`):

    bash .vllm-gpu/device.sh put .vllm-gpu/d && bash .vllm-gpu/device.sh install \
      && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . \
      && PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/e2e/run_e2e.py \
         --out $OUT

(`--quick`: one workload and one request rate; `--dry-run`: everything up to the first engine.)

The pip line installs fuselane into /tmp/site with its `vllm.general_plugins` entry point, which
is how vLLM finds the plugin in every engine process.

What a run measures (workload_sets.py; docs/notes/e2e.md has one command per cell of the
matrix): `--model NAME|DIR` (a folder of benchmarks/e2e/models/ by name: llama-3-8b, the
default, qwen2.5-1.5b, qwen2.5-7b, mistral-7b-v0.1, gemma-2-9b; or any folder with a
config.json), `--workloads default|sampling|long-prompts|long-decode` (the set and its
sampling; `--long-decode-requests N`, else 16, or 8 below 100 GiB of GPU memory), and
`--kv-cache-dtype auto|fp8|fp8_e4m3` (every arm alike: FLASH_ATTN stays fuselane's reference,
TRITON_ATTN the bound). The engine's max_model_len follows the set and the model.

`--golden write|check --golden-file FILE` runs the offline engines' greedy correctness pass only
(32 tokens, top-5 logprobs; FLASH_ATTN, fuselane and TRITON_ATTN unless `--arms` says otherwise)
and writes FLASH_ATTN's outputs as the golden file, or checks every arm against the file with the
correctness verdict's rule, TRITON_ATTN setting the bound (golden.py). Every run records each
arm's memory figures (KV-cache blocks, GPU memory peaks, CUDA-graph capture time and memory;
memory.py) and flags a fuselane arm whose KV capacity differs from its reference's or whose
capture takes more than 1.2x as long.

The script is split by concern; this file keeps the arguments and the orchestration:
`settings.py` (the run's settings and prompts, which `--smoke` shrinks), `workload_sets.py` (the
model folders, workload sets and KV dtype, and the engine shape they give), `arms.py` (the engine
configurations, their engine arguments, server command and environment), `processes.py` (engine
processes in their own process group, stopped with all they spawned; server readiness; log
scanning), `offline.py` (the offline engine's subprocess body), `online.py` (the server run and
its load), `correctness.py` (the greedy pass, the comparison with the reference and the verdict
rule), `golden.py` (the golden file), `memory.py` (memory and capture figures, their check),
`report.py` (the JSON, its merge across runs, the table) and `prefill_probe.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The sibling modules are imported by their own names, from this folder: so they are found
# however the script is started (by path, with -m, or loaded by path in the tests), without
# fuselane installed, and one copy of each serves every caller (`settings` is changed in place).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import golden  # noqa: E402
import settings  # noqa: E402
import workload_sets  # noqa: E402
from arms import (  # noqa: E402
    ONLINE_PRIORITY,
    Arm,
    arm_env,
    engine_kwargs,
    every_arm,
    make_arms,
    reference_of,
    server_command,
    v1_runner_arms,
)
from correctness import LOGPROB_ATOL, compare_correctness, correctness_verdict  # noqa: E402
from memory import parse_memory_log  # noqa: E402
from offline import worker_offline  # noqa: E402
from online import run_online, write_tokenizer_model_dir  # noqa: E402
from processes import exit_on_termination, owned_process, run_engine_process, scan_log  # noqa: E402
from report import (  # noqa: E402
    device_info,
    finish_report,
    merge_reports,
    new_report,
    ratios,
    table,
    write_report,
)
from settings import build_prompts, correctness_prompts, online_plan, selected_workloads  # noqa: E402

# What the script offers its callers (the tests): the names below, and the run's settings
# (`run_e2e.MAX_MODEL_LEN`, ...) through `__getattr__`.
__all__ = [
    "LOGPROB_ATOL",
    "ONLINE_PRIORITY",
    "arm_env",
    "build_prompts",
    "compare_correctness",
    "correctness_prompts",
    "correctness_verdict",
    "engine_kwargs",
    "every_arm",
    "exit_on_termination",
    "main",
    "make_arms",
    "merge_reports",
    "online_plan",
    "owned_process",
    "parse_args",
    "parse_memory_log",
    "ratios",
    "reference_of",
    "scan_log",
    "selected_workloads",
    "server_command",
    "table",
    "v1_runner_arms",
    "write_tokenizer_model_dir",
]


def __getattr__(name: str) -> Any:
    """The run's settings (upper-case names) read from `settings` at each access, not copied
    here at import: `--smoke` and the flags replace them there."""
    if name.isupper() and hasattr(settings, name):
        return getattr(settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The arms of a golden run unless --arms names others: the reference, fuselane, the bound.
GOLDEN_ARMS = (golden.REFERENCE_ARM, "fuselane", golden.BOUND_ARM)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="output dir (default $OUT)")
    p.add_argument(
        "--model",
        default=str(settings.DEFAULT_MODEL),
        help="model folder (config.json), or the name of one in benchmarks/e2e/models/: "
        + ", ".join(workload_sets.model_names()),
    )
    p.add_argument(
        "--workloads",
        choices=workload_sets.SET_NAMES,
        default="default",
        help="workload set (its sampling, arms and max_model_len; workload_sets.py)",
    )
    p.add_argument(
        "--long-decode-requests",
        type=int,
        metavar="N",
        help="requests of the long-decode set (default: 16, or 8 below 100 GiB of GPU memory)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=workload_sets.KV_CACHE_DTYPES,
        default="auto",
        help="vLLM's kv_cache_dtype, every arm alike",
    )
    p.add_argument("--arms", nargs="*", default=None, help="subset of arms, in this order")
    p.add_argument("--quick", action="store_true", help="one workload, one request rate")
    p.add_argument("--dry-run", action="store_true", help="stop before the first engine")
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--online-only", action="store_true", help="servers only (no offline engines)")
    p.add_argument("--budget-s", type=float, default=530.0, help="whole-run time budget")
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs per engine (vLLM's flag)"
    )
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="fuselane arms' servers export kernel metrics (FUSELANE_TELEMETRY=1 and a fresh "
        "PROMETHEUS_MULTIPROC_DIR); their fuselane_* samples are kept in the report",
    )
    p.add_argument("--no-results-copy", action="store_true", help="no copy in benchmarks/results")
    p.add_argument(
        "--work-dir",
        help=f"engines' results, compile caches and traces (default {settings.WORK_DIR}): one "
        "per run where several run at once on one host, one GPU each",
    )
    p.add_argument(
        "--probe-only",
        action="store_true",
        help="offline engines time lone prefills only (no correctness pass, no workloads, "
        "no servers)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one lone prefill per length with vLLM's torch profiler (kernel summary)",
    )
    p.add_argument(
        "--golden",
        choices=golden.MODES,
        help="greedy correctness pass only (32 tokens, top-5 logprobs): write FLASH_ATTN's "
        "outputs to --golden-file, or check every arm against that file (no workloads, no "
        "servers)",
    )
    p.add_argument("--golden-file", metavar="JSON", help="the golden file of --golden")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine the results of several runs of one lease (same device) into one report "
        "(ratios and correctness recomputed across all their arms), then exit",
    )
    # internal: the arm's offline engine subprocess
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["offline"], help=argparse.SUPPRESS)
    p.add_argument("--worker-arm", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_only and args.online_only:
        p.error("--probe-only times offline engines; it cannot go with --online-only")
    if args.golden and (args.probe_only or args.online_only):
        p.error("--golden runs the offline correctness pass; not with --probe-only/--online-only")
    if args.golden and not args.golden_file and not args.worker:
        p.error("--golden needs --golden-file")
    if args.workloads != "default" and (args.golden or args.online_only):
        p.error(f"--workloads {args.workloads} runs offline workloads: not with --golden or "
                "--online-only")  # fmt: skip
    if args.long_decode_requests is not None and args.long_decode_requests < 1:
        p.error("--long-decode-requests must be at least 1")
    if not args.merge:
        try:
            args.model = str(workload_sets.resolve_model(args.model))
        except ValueError as e:
            p.error(str(e))
    wset = workload_sets.workload_set(args.workloads)
    if not wset.online:  # the servers' load has the default set's shape
        args.skip_online = True
    if args.arms is None and wset.arms is not None:
        args.arms = list(wset.arms)
    # The probe and the golden pass are offline: no servers after them.
    args.skip_online = args.skip_online or args.probe_only or bool(args.golden)
    if args.golden and not args.arms:
        args.arms = list(GOLDEN_ARMS)
    return args


def run_arm_offline(
    arm: Arm, args: argparse.Namespace, logs: Path, timeout: float
) -> dict[str, Any]:
    """The arm's offline engine: this script again, as `--worker offline`, in its own process."""
    result_path = settings.WORK_DIR / f"offline-{arm.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "offline"]
    cmd += ["--worker-arm", arm.name, "--worker-result", str(result_path), "--model", args.model]
    # The run's shape, decided here once (the long-decode count may come from the GPU memory).
    cmd += ["--workloads", args.workloads, "--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--long-decode-requests", str(args.long_decode_requests)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--probe-only"] if args.probe_only else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--golden", args.golden] if args.golden else []
    cmd += ["--work-dir", str(settings.WORK_DIR)]
    log_path = logs / f"{arm.name}-offline.log"
    res = run_engine_process(cmd, arm_env(arm), log_path, result_path, timeout)
    res.setdefault("memory", {})["log"] = parse_memory_log(log_path.read_text(errors="replace"))
    return res


def publish(report: dict[str, Any], out_dir: Path | None, copy_to_results: bool) -> None:
    """Write the report, say where, and print its table."""
    for path in write_report(report, out_dir, copy_to_results):
        print(f"wrote {path}")
    print(table(report))


def apply_run_shape(args: argparse.Namespace) -> str | None:
    """The model, workload set and KV dtype into `settings` (workload_sets.plan_shape); fills
    in args.long_decode_requests for the workers. Returns the long-decode rule's reason when the
    rule chose the count."""
    rule = None
    if args.long_decode_requests is None:
        mib = None
        if args.workloads == "long-decode":  # nvidia-smi only where the count depends on it
            mib = workload_sets.gpu_memory_mib(device_info())
        args.long_decode_requests = workload_sets.long_decode_requests(
            mib, args.tensor_parallel_size
        )
        if args.workloads == "long-decode":
            rule = (
                f"long-decode: {args.long_decode_requests} requests (GPU memory "
                f"{'unknown' if mib is None else f'{mib:.0f} MiB'} x "
                f"{args.tensor_parallel_size}; 16 at >= {workload_sets.LONG_DECODE_BIG_GPU_GIB:g}"
                " GiB, else 8)"
            )
    shape = workload_sets.plan_shape(
        args.workloads,
        workload_sets.read_model_config(args.model),
        smoke=args.smoke,
        kv_cache_dtype=args.kv_cache_dtype,
        long_decode_requests=args.long_decode_requests,
    )
    workload_sets.apply_shape(shape)
    return rule


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out) if args.out else None
    if args.merge:
        publish(merge_reports(args.merge), out_dir, not args.no_results_copy)
        return 0
    if args.smoke:
        settings.apply_smoke()
    if args.golden:
        settings.apply_golden()
    if args.work_dir:
        settings.WORK_DIR = Path(args.work_dir)
    settings.TENSOR_PARALLEL, settings.TELEMETRY = args.tensor_parallel_size, args.telemetry
    rule = apply_run_shape(args)
    if args.worker == "offline":
        arm = next(a for a in every_arm() if a.name == args.worker_arm)
        return worker_offline(
            arm,
            args.model,
            selected_workloads(args.quick),
            Path(args.worker_result),
            probe_only=args.probe_only,
            profile=args.profile,
            golden=bool(args.golden),
        )
    exit_on_termination()
    t_start = time.monotonic()
    report = new_report(args)
    if rule:
        report["notes"].append(rule)
    arms = make_arms(args.arms)
    if args.dry_run:
        for arm in arms:
            report["arms"][arm.name] = {
                "status": "dry-run",
                "engine_kwargs": engine_kwargs(arm, args.model),
                "env": arm.env,
                "server_command": server_command(arm, "MODEL_WITH_TOKENIZER", 0),
            }
        report["dry_run_prompts"] = {
            w.name: len(build_prompts(w.num_prompts, w.input_len, w.seed))
            for w in selected_workloads(args.quick)
        }
        finish_report(report)
        print(json.dumps(report["plan"], indent=1))
        publish(report, out_dir, False)
        return 0
    work_dir = settings.WORK_DIR
    work_dir.mkdir(parents=True, exist_ok=True)
    logs = (out_dir or work_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    server_model = None
    if not args.skip_online:
        try:
            server_model = write_tokenizer_model_dir(model, work_dir / "model-with-tokenizer")
            report["online_tokenizer"] = "generated word-level tokenizer t0..t<vocab-1>"
        except Exception as e:  # noqa: BLE001 - online is skipped, offline goes on
            report["online_tokenizer"] = f"failed: {type(e).__name__}: {e}"
    # Rough costs (s) used to decide what still fits in the budget. Every arm's offline
    # engine runs first (the throughput numbers matter most), then the servers in the same
    # order, so a tight budget drops TRITON_ATTN's server first.
    est_offline = workload_sets.workload_set(args.workloads).est_offline_s
    est_offline, est_online = (est_offline, 70.0) if not args.quick else (est_offline - 20, 60.0)
    if args.golden:  # engine start and one short greedy pass
        est_offline = 75.0
    for arm in arms:
        res: dict[str, Any] = {}
        report["arms"][arm.name] = res
        left = args.budget_s - (time.monotonic() - t_start)
        if arm.needs_fuselane and report["fuselane_entry_point"] is None:
            error = "fuselane's vllm.general_plugins entry point is not installed"
            res.update(status="failed", error=f"{error} (pip install --target /tmp/site .)")
            continue
        if args.online_only:
            res["status"] = "ok"
            continue
        if left < est_offline * 0.8:
            res.update(status="skipped", error=f"time budget: {left:.0f}s left")
            continue
        print(f"[e2e] {arm.name}: offline engine ({left:.0f}s of budget left)", flush=True)
        off = run_arm_offline(arm, args, logs, timeout=max(60.0, left - 10))
        res.update({k: v for k, v in off.items() if k != "correctness"})
        res["correctness_raw"] = off.get("correctness")
        write_report(finish_report(report), out_dir, False)  # partial results as the run goes
    for arm in sorted(arms, key=lambda a: ONLINE_PRIORITY.index(a.name)):
        res = report["arms"][arm.name]
        if res.get("status") != "ok":
            continue
        left = args.budget_s - (time.monotonic() - t_start)
        if args.skip_online or server_model is None:
            res["online"] = {"status": "skipped", "error": report.get("online_tokenizer")}
        elif left < est_online:
            res["online"] = {"status": "skipped", "error": f"time budget: {left:.0f}s left"}
        else:
            print(f"[e2e] {arm.name}: online server ({left:.0f}s left)", flush=True)
            log_path = logs / f"{arm.name}-server.log"
            try:
                res["online"] = run_online(
                    arm, server_model, log_path, args.quick, min(args.start_timeout_s, left)
                )
            except Exception as e:  # noqa: BLE001 - recorded
                res["online"] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            if log_path.exists():
                text = log_path.read_text(errors="replace")
                res["online"]["log"] = scan_log(text)
                res["online"]["memory_log"] = parse_memory_log(text)
        if (res.get("online") or {}).get("status") != "ok":
            res["status"] = "partial"
        write_report(finish_report(report), out_dir, False)
    if args.golden:
        report["golden"] = golden.run(args.golden, Path(args.golden_file), report, args.model)
    report["elapsed_s"] = time.monotonic() - t_start
    finish_report(report)
    publish(report, out_dir, not args.no_results_copy)
    # A golden check that fails (or a file that could not be written or read) fails the run.
    return 1 if args.golden and not report["golden"]["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())

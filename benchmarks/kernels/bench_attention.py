"""GPU benchmark of the paged-attention family (kernels/attention/) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_attention.py --out $OUT [--quick] [--no-sweep] [--prefill-only]

Order of work, all in one process on one device:
  1. ceilings: copy bandwidth (1 GiB device-to-device), bf16 GEMM rate, empty Triton kernel;
  2. check: fuselane against its torch reference (`paged_attention_reference`) on fresh random
     inputs over several shapes (decode with splits, speculative verify, prefill, mixed; GQA
     1..8 and 7, head sizes 64/80/96/128/256, pages 16/32/64, fp16/bf16, fp8 KV, window,
     soft cap, sinks): PASS/FAIL lines with the max error;
  3. decode, prefill, mixed (the goal cases, as the peers' H200 anchors): each case first
     checks fuselane's output on the timed inputs against the reference (a case that fails is
     not timed for fuselane), then times fuselane and every peer on the same inputs by
     CUDA-graph replay (`harness.time_graph`; `time_eager` with a note if a peer cannot be
     captured);
  4. sweeps, at every decode case and prefill length, in SWEEP_ORDER until BUDGET_S: the decode
     kernel at other (tile, stages, splits, merge as a 2nd launch, grid order) and the prefill
     kernel at other (block_m, block_n, warps, stages, grid order) than the launch rule picks,
     each checked against the reference before timing, and fuselane's outputs checked again
     after the graph replays (a race in the fused split merge would show there);
  5. GOAL lines (the family's targets), then the table; JSON to --out and benchmarks/results/.

Workload (Llama-3-8B attention, as the peers' H200 anchors): Hq=32, Hkv=8, D=128, page 16, bf16,
scale 1/sqrt(D). One KV pool of ~4.3 GB ([pages, 2, page, Hkv, D], random data; K and V are
its [:, 0] / [:, 1] views for fuselane and vLLM, the 5-D tensor itself for FlashInfer), pages
handed out as a random permutation. Decode: every sequence at the same context length.
Prefill: one sequence, query_len == seq_len (its KV already in the cache, as vLLM writes it
before attention). Mixed: 60 decode rows then 4 prefill chunks of 512, all at seq_len 4096.
Bytes counted for decode: K and V read, plus q read and out written. FLOPs for prefill:
2 * S^2 * Hq * D (causal half of 4 S^2 Hq D), as the anchors.
Peers: vLLM's `unified_attention` (TRITON_ATTN's kernel, with its 3-D split scratch sized as
triton_attn.py does), FlashInfer 0.2.14 BatchDecodeWithPagedKVCacheWrapper (tensor cores)
and BatchPrefillWithPagedKVCacheWrapper (plan() outside the timed region), torch SDPA (flash
and cuDNN backends) on dense MHA-expanded tensors for prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:  # an installed checkout (pip install -e .)
    from fuselane.benchmarks import harness
    from fuselane.kernels import attention as attn
except ImportError:  # a bare checkout (the GPU machine): the root folders are packages
    from benchmarks import harness
    from kernels import attention as attn

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
SCALE = 1.0 / math.sqrt(D)
DECODE_CASES = [(1, 32768), (16, 4096), (64, 4096), (128, 8192), (256, 2048)]
PREFILL_LENS = (4096, 8192, 16384)
MIXED_DECODES, MIXED_CHUNKS, MIXED_CHUNK, MIXED_SEQ_LEN = 60, 4, 512, 4096
# KV pool: enough pages for the largest decode case (128 x 8192 tokens = 4.3 GB in bf16)
POOL_PAGES = max(b * ctx for b, ctx in DECODE_CASES) // PAGE + 256
# Split-KV workspace of the benchmark: room for 64 splits of 256 query rows (sweeps included:
# B=256 with 2 splits), 268 MB
WS_ROWS, WS_SPLITS = 256, 64
# vLLM TRITON_ATTN's scratch for its 3-D (split) path, as triton_attn.py sizes it
VLLM_SEQ_THRESHOLD_3D = 128 // HKV
VLLM_SEGMENTS = 16
# Check tolerances against the fp32 reference (the GPU rounds to nearest; see the tests' table)
TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}
PREFILL_CHECK_ROWS = 256  # prefill cases check their first and last rows (the reference is O(S^2))
# Goals of the attention family
GOAL_PCT_COPY = 90.0  # decode, B >= 16
GOAL_B1_TBPS = 3.0  # decode B=1 ctx=32768 (H200)
GOAL_OVER_SDPA = 1.1  # prefill TFLOP/s vs torch SDPA flash
GOAL_OVER_FI_PREFILL = 0.9  # prefill TFLOP/s vs FlashInfer
DEVICE = "cuda"  # a module constant so that the script's logic can be dry-run elsewhere
BUDGET_S = 270.0  # sweeps are skipped past this many seconds (a run must stay under 5 minutes)

# Sweeps (after every goal case). Decode: changes to the Triton kernel's plan, or with
# warp_specialized=True to the Hopper kernel's (bench_decode_sweep). The Triton rule
# (kernels/attention/plan.py, DECODE_STAGES_PIPELINED): 3 stages, two programs per SM,
# kv-head-fastest grid, unless 5 stages with one program per SM fill the unsplit batch's waves
# clearly better; on Hopper, B <= SMs / (4 x Hkv) takes the warp-specialized kernel
# (DECODE_WS_TILE).
DECODE_SWEEP_LARGE_B = [
    dict(head_fast=False),  # run 5's default
    dict(num_stages=5),
    dict(tile_n=64, num_stages=7),
]
DECODE_SWEEP = {
    1: [dict(),  # the Triton kernel's rule (the Hopper rule's before 2026-11-26)
        dict(num_stages=5, num_splits=16, head_fast=False),
        # Hopper's warp-specialized decode kernel: `num_stages` K/V slots of `tile_n` tokens
        *(dict(warp_specialized=True, tile_n=t, num_stages=b, num_splits=n)
          for t, b, n in ((64, 4, 16), (64, 6, 16), (128, 3, 16), (128, 2, 12), (128, 2, 20)))],
    16: [dict(num_splits=2), dict(num_stages=3, num_splits=2, head_fast=True),
         *(dict(warp_specialized=True, tile_n=t, num_stages=b, num_splits=1)
           for t, b in ((64, 4), (128, 2)))],
    64: DECODE_SWEEP_LARGE_B,
    128: DECODE_SWEEP_LARGE_B,
    256: DECODE_SWEEP_LARGE_B,
}  # fmt: skip
# Batches between the measured cases, where the rule switches regime (ctx 4096): each timed
# with the rule's plan and with the other regime's plan, or the Triton kernel's plan where the
# rule took the Hopper kernel (decode_rule section).
DECODE_RULE_BATCHES = (2, 4, 8, 24, 32, 40, 48)
# Prefill: (block_m, block_n, num_warps, num_stages, head_fast) at every prefill length; the
# Triton rule picks 256x64, 16 warps, 7 stages, kv-head-fastest grid; on Hopper the
# warp-specialized kernel's PREFILL_WS_TILE (sweep points equal to the rule's config are
# skipped). For the Triton kernel with wgmma the pipeliner keeps one more K/V buffer than for
# mma.sync, but at 3 stages still waits for every copy at the top of each iteration
# (async_wait num=0); 5 stages keep one tile in flight (two buffers), 7 stages two (three
# buffers, 193 KiB at 256x64).
PREFILL_SWEEP = [  # (block_m, block_n, warps, stages, head_fast[, warp-specialized])
    (256, 64, 16, 7, True),  # the Triton kernel's rule (the Hopper rule's before 2026-11-26)
    # Hopper's warp-specialized kernel: two compute warpgroups of block_m / 2 rows (warps = 4
    # per warpgroup), one loader warpgroup, `stages` K/V slots.
    (256, 64, 4, 4, True, True),  # the Hopper rule
    (256, 64, 4, 5, True, True),
    (256, 64, 4, 3, True, True),
    (256, 64, 4, 4, False, True),
]
# Prefill length also timed on the engine's tensor layout (bench_prefill_engine_layout) and
# with a cold L2 (bench_prefill_cold_l2): in vLLM the kernel measured ~15% slower than here at
# 8192 tokens (e2e lone-prefill profile).
ENGINE_LAYOUT_SEQ = 8192
# Bytes written between calls to evict the previous call's K/V from L2 (H100 / H200: 50 MB).
L2_FLUSH_BYTES = 256 << 20
# Order of the sweeps when the time budget may cut them: most informative first.
SWEEP_ORDER = [("decode", 1), ("decode", 16), ("prefill", 8192), ("decode", 128),
               ("decode", 256), ("prefill", 16384), ("decode", 64), ("prefill", 4096)]  # fmt: skip


def decode_case(batch: int, ctx: int) -> str:
    return f"B={batch} ctx={ctx} Hq={HQ} Hkv={HKV} D={D} page={PAGE}"


def prefill_case(seq: int) -> str:
    return f"S={seq} Hq={HQ} Hkv={HKV} D={D} causal paged"


MIXED_CASE = (
    f"{MIXED_CHUNKS}x{MIXED_CHUNK} prefill chunks + {MIXED_DECODES} decodes, ctx {MIXED_SEQ_LEN}, "
    f"Hq={HQ} Hkv={HKV} D={D}"
)


# ----------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One call's inputs, as fuselane/vLLM (block table) and FlashInfer (indptr form) see them."""

    q: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [pages, 2, page, Hkv, D]
    cu: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    q_lens: list[int]
    lens: list[int]
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [pages used] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.q_lens)

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv[:, 1]

    def args(self, **options) -> dict:
        """Keyword arguments of paged_attention / paged_attention_reference (minus out)."""
        return dict(
            q=self.q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            cu_seqlens_q=self.cu,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            max_query_len=max(self.q_lens),
            # as vLLM's backend passes it: a batch of prefill chunks has no decode launch
            min_query_len=min((n for n in self.q_lens if n > 0), default=0),
            max_seq_len=max(self.lens),
            scale=options.pop("scale", SCALE),
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            **options,
        )


def make_pool(num_pages: int, page: int, heads: int, head_size: int, dtype) -> torch.Tensor:
    """Random KV pages [num_pages, 2, page, heads, head_size] (fp8: e4m3 codes of 2*randn)."""
    if dtype == FP8:
        return (torch.randn(num_pages, 2, page, heads, head_size, device=DEVICE) * 2).to(FP8)
    return torch.randn(num_pages, 2, page, heads, head_size, device=DEVICE, dtype=dtype)


def make_problem(
    q_lens: list[int],
    lens: list[int],
    gen: torch.Generator,
    *,
    kv: torch.Tensor | None = None,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
    page: int = PAGE,
    dtype=DTYPE,
    kv_dtype=None,
) -> Problem:
    """A batch over `kv` (or a fresh pool just large enough), pages a random permutation."""
    pages = [math.ceil(n / page) for n in lens]
    if kv is None:
        kv = make_pool(sum(pages) + 8, page, hkv, d, kv_dtype or dtype)
    page, hkv, d = kv.shape[2], kv.shape[3], kv.shape[4]
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(pages)].to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start : start + n]
        start += n
    i32 = dict(dtype=torch.int32, device=DEVICE)
    indptr = [0, *torch.tensor(pages).cumsum(0).tolist()]
    last = [n - (p - 1) * page for n, p in zip(lens, pages, strict=True)]
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, dtype)
    scales = {}
    if kv.dtype == FP8:
        scales = dict(
            k_scale=torch.tensor([0.37], device=DEVICE), v_scale=torch.tensor([0.61], device=DEVICE)
        )
    return Problem(
        q=q,
        kv=kv,
        cu=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], **i32),
        seq_lens=torch.tensor(lens, **i32),
        block_table=table.to(DEVICE),
        q_lens=list(q_lens),
        lens=list(lens),
        kv_indptr=torch.tensor(indptr, **i32),
        kv_indices=perm.to(DEVICE),
        kv_last_page_len=torch.tensor(last, **i32),
        **scales,
    )


def sub_problem(p: Problem, rows: slice, seq_len: int) -> Problem:
    """One sequence of `p` cut to query rows `rows` ending at key `seq_len` (for checks)."""
    q_len = rows.stop - rows.start
    return dataclasses.replace(
        p,
        q=p.q[rows],
        cu=torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        block_table=p.block_table[:1],
        q_lens=[q_len],
        lens=[seq_len],
    )


def reference(p: Problem, **options) -> torch.Tensor:
    """The fp32 reference's output on `p` (rows past the batch stay NaN)."""
    ref = torch.full_like(p.q, float("nan"))
    return attn.paged_attention_reference(out=ref, **p.args(**options))


def compare(out: torch.Tensor, ref: torch.Tensor, rows: int) -> tuple[bool, str]:
    """out[:rows] against ref[:rows]: (within the dtype's tolerance and NaN-free, description)."""
    got, want = out[:rows].float(), ref[:rows].float()
    atol, rtol = TOL[out.dtype]
    diff = (got - want).abs().nan_to_num(float("inf"))
    ok = bool((diff <= atol + rtol * want.abs()).all())
    return ok, f"max abs err {float(diff.max()):.3g} (atol {atol}, rtol {rtol}), rows {rows}"


def max_error(out: torch.Tensor, p: Problem, **options) -> tuple[bool, str]:
    return compare(out, reference(p, **options), p.num_rows)


class Expected:
    """Reference outputs of one timed case, computed once and compared with every impl.

    Prefill cases (O(S^2) reference) check their first and last PREFILL_CHECK_ROWS rows: the
    first rows are a prefill of that length, the last ones a chunk ending at key S.
    """

    def __init__(self, p: Problem, prefill: bool = False, **options) -> None:
        """options: the case's options of `reference` (scale, sliding_window, softcap, ...)."""
        self.prefill = prefill
        if prefill:
            s = p.lens[0]
            self.rows = r = min(PREFILL_CHECK_ROWS, s)
            self.head = reference(sub_problem(p, slice(0, r), r), **options)
            self.tail = reference(sub_problem(p, slice(s - r, s), s), **options)
            self.seq = s
        else:
            self.full = reference(p, **options)
            self.rows = p.num_rows

    def check(self, out: torch.Tensor) -> tuple[bool, str]:
        if not self.prefill:
            return compare(out, self.full, self.rows)
        r = self.rows
        ok1, d1 = compare(out[:r], self.head, r)
        ok2, d2 = compare(out[self.seq - r : self.seq], self.tail, r)
        return ok1 and ok2, f"first rows: {d1}; last rows: {d2}"


# ----------------------------------------------------------------------------------------------
# Peers (each optional: a failure to import or to run is recorded and the run goes on)
# ----------------------------------------------------------------------------------------------


class Peers:
    def __init__(self, report: harness.Report) -> None:
        self.report = report
        self.vllm: Callable | None = None
        self.flashinfer = None
        self.fi_workspace: torch.Tensor | None = None
        try:
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention

            self.vllm = unified_attention
        except Exception as e:  # noqa: BLE001 - any import failure disables this peer
            self.note(f"vllm unified_attention unavailable: {e!r}")
        try:
            import flashinfer

            self.flashinfer = flashinfer
            self.fi_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
        except Exception as e:  # noqa: BLE001
            self.note(f"flashinfer unavailable: {e!r}")
        # vLLM's split scratch, sized as TritonAttentionMetadataBuilder does for Hq=32, D=128
        rows = VLLM_SEQ_THRESHOLD_3D
        f32 = dict(dtype=torch.float32, device=DEVICE)
        self.segm_out = torch.empty(rows, HQ, VLLM_SEGMENTS, D, **f32)
        self.segm_max = torch.empty(rows, HQ, VLLM_SEGMENTS, **f32)
        self.segm_expsum = torch.empty(rows, HQ, VLLM_SEGMENTS, **f32)

    def note(self, text: str) -> None:
        print(f"NOTE {text}", flush=True)
        self.report.notes.append(text)

    def vllm_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        num_seqs = len(p.lens)
        one = torch.ones((), dtype=torch.float32, device=DEVICE)
        descale = one.expand(num_seqs, HKV)  # as triton_attn.py: layer._k_scale.expand(...)

        def fn():
            self.vllm(
                q=p.q,
                k=p.key_cache,
                v=p.value_cache,
                out=out,
                cu_seqlens_q=p.cu,
                max_seqlen_q=max(p.q_lens),
                seqused_k=p.seq_lens,
                max_seqlen_k=max(p.lens),
                softmax_scale=SCALE,
                causal=True,
                window_size=(-1, -1),
                block_table=p.block_table,
                softcap=0,
                q_descale=None,
                k_descale=descale,
                v_descale=descale,
                seq_threshold_3D=VLLM_SEQ_THRESHOLD_3D,
                num_par_softmax_segments=VLLM_SEGMENTS,
                softmax_segm_output=self.segm_out,
                softmax_segm_max=self.segm_max,
                softmax_segm_expsum=self.segm_expsum,
            )

        return fn

    def fi_decode_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.fi_workspace, "NHD", use_tensor_cores=True
        )
        wrapper.plan(
            p.kv_indptr, p.kv_indices, p.kv_last_page_len, HQ, HKV, D, PAGE,
            q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=SCALE,
        )  # fmt: skip
        return lambda: wrapper.run(p.q, p.kv, out=out)

    def fi_prefill_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.fi_workspace, "NHD")
        wrapper.plan(
            p.cu, p.kv_indptr, p.kv_indices, p.kv_last_page_len, HQ, HKV, D, PAGE,
            causal=True, sm_scale=SCALE, q_data_type=DTYPE, kv_data_type=DTYPE,
        )  # fmt: skip
        return lambda: wrapper.run(p.q, p.kv, out=out)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, report: harness.Report, t_start: float) -> None:
        self.report = report
        self.peers = Peers(report)
        self.t_start = t_start
        self.workspace = attn.AttentionWorkspace.allocate(
            WS_ROWS, HQ, D, torch.device(DEVICE), max_splits=WS_SPLITS
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def time(
        self,
        section: str,
        case: str,
        impl: str,
        fn: Callable[[], object],
        *,
        nbytes: float | None = None,
        flops: float | None = None,
        extra: dict | None = None,
    ) -> float | None:
        """Per-call ms by graph replay (eager if capture fails, noted); None if it cannot run."""
        extra = dict(extra or {})
        try:
            est = estimate_ms(fn)
            calls = max(1, min(20, round(5.0 / est)))  # ~5 ms per replay
            reps = max(5, min(50, round(300.0 / (est * calls))))  # ~0.3 s per measurement
            try:
                ms = harness.time_graph(fn, calls_per_graph=calls, reps=reps)
            except Exception as e:  # noqa: BLE001 - fall back to eager timing, say so
                torch.cuda.synchronize()
                ms = harness.time_eager(fn, reps=reps)
                extra["timing"] = f"eager (graph capture failed: {type(e).__name__})"
                self.peers.note(f"{section} {case} {impl}: graph capture failed ({e!r}), eager")
        except Exception as e:  # noqa: BLE001 - an impl that cannot run is reported, not fatal
            self.peers.note(f"{section} {case} {impl}: timing failed: {e!r}")
            torch.cuda.synchronize()
            return None
        row = self.report.add(harness.Row(section, case, impl, ms, nbytes, flops, extra))
        rate = ""
        if row.tbps is not None:
            rate = f"{row.tbps:7.3f} TB/s"
        elif row.tflops is not None:
            rate = f"{row.tflops:7.1f} TFLOP/s"
        print(f"  {section:<10} {case:<44} {impl:<52} {ms * 1e3:10.2f} us {rate}", flush=True)
        return ms


def estimate_ms(fn: Callable[[], object]) -> float:
    """One warm eager call, for sizing the timing loop (compiles / JIT builds happen here)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end) / 3, 1e-3)


def try_run(peers: Peers, label: str, fn: Callable[[], object]) -> bool:
    """Run fn once (compiles / JIT builds happen here); False and a note if it raises."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001
        peers.note(f"{label}: failed to run: {e!r}")
        traceback.print_exc()
        return False


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def fuselane_fn(run: Runner, p: Problem, out: torch.Tensor, plan=None) -> Callable[[], object]:
    args = p.args()
    if plan is None:
        return lambda: attn.paged_attention(out=out, workspace=run.workspace, **args)
    a = args

    def fn():  # a sweep point: the same launch code with another config
        attn.run._run(
            a["q"], a["key_cache"], a["value_cache"], out, a["cu_seqlens_q"], a["seq_lens"],
            a["block_table"], a["max_query_len"], a["scale"], 0, 0.0, None, a["k_scale"],
            a["v_scale"], run.workspace, plan=plan,
        )  # fmt: skip

    return fn


def default_plan(p: Problem, run: Runner, warp_specialized: bool | None = None) -> attn.LaunchPlan:
    """The launch rule's plan for `p` (warp_specialized: None = as `paged_attention` decides)."""
    if warp_specialized is None:
        warp_specialized = attn.warp_specialized_ok(
            p.q, p.key_cache, p.value_cache, sliding_window=0, softcap=0.0, has_sinks=False
        )
    return attn.plan_launch(
        num_seqs=len(p.lens),
        num_q_heads=p.q.shape[1],
        num_kv_heads=p.kv.shape[3],
        head_size=p.q.shape[2],
        max_query_len=max(p.q_lens),
        sms=attn.sm_count(p.q.device),
        workspace=run.workspace,
        kv_bytes=p.kv.element_size(),
        max_smem=attn.smem_per_block(p.q.device),
        warp_specialized=warp_specialized,
    )


def plan_extra(plan: attn.LaunchPlan) -> dict:
    d = plan.decode
    extra = {
        "decode": f"splits={d.num_splits} tile={d.tile_n} w={d.num_warps} s={d.num_stages} "
        f"fused={d.fused_reduce} head_fast={d.head_fast} ws={d.warp_specialized}"
    }
    if plan.prefill is not None:
        f = plan.prefill
        extra["prefill"] = (
            f"{f.block_m}x{f.block_n} w={f.num_warps} s={f.num_stages} head_fast={f.head_fast}"
            f" ws={f.warp_specialized}"
        )
    return extra


# ----------------------------------------------------------------------------------------------
# 2. GPU check against the reference
# ----------------------------------------------------------------------------------------------

CHECKS = [
    # (q_lens, seq_lens, Hq, Hkv, D, page, q dtype, kv dtype, options)
    ([1, 1, 1], [1, 1000, 5000], 32, 8, 128, 16, DTYPE, None, {}),
    ([1] * 5, [17, 64, 65, 300, 2500], 8, 1, 64, 32, torch.float16, None, {}),
    ([4, 4, 4], [4, 90, 1200], 28, 4, 128, 16, DTYPE, None, {}),
    ([1, 3, 300, 1, 77], [900, 50, 1500, 1, 77], 32, 8, 128, 16, DTYPE, None, {}),
    ([1024], [1024], 32, 8, 128, 16, DTYPE, None, {}),
    ([1, 5, 200, 1], [3000, 40, 700, 9], 16, 4, 128, 16, DTYPE, FP8,
     dict(sliding_window=256, softcap=30.0, sinks="randn")),
    ([1, 2, 130, 1], [400, 70, 1000, 2], 8, 2, 256, 64, DTYPE, None, {}),
    ([1, 1, 90, 6], [2000, 33, 600, 100], 12, 4, 80, 16, torch.float16, None,
     dict(sliding_window=100)),
    ([1] * 4, [1, 31, 700, 4000], 32, 32, 96, 32, torch.float16, None, {}),
    ([1, 64, 8], [128, 64, 300], 4, 4, 64, 64, DTYPE, FP8, dict(sinks="randn")),
]  # fmt: skip


def run_checks(run: Runner) -> bool:
    gen = torch.Generator().manual_seed(1234)
    all_ok = True
    for q_lens, lens, hq, hkv, d, page, dtype, kv_dtype, options in CHECKS:
        name = (
            f"q_lens={q_lens} seq_lens={lens} Hq={hq} Hkv={hkv} D={d} page={page} "
            f"{str(dtype)[6:]} kv={str(kv_dtype or dtype)[6:]} {sorted(options)}"
        )
        try:
            p = make_problem(q_lens, lens, gen, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype,
                             kv_dtype=kv_dtype)  # fmt: skip
            opts = dict(options)
            if opts.get("sinks") == "randn":
                opts["sinks"] = torch.randn(hq, generator=gen).to(DEVICE) * 2
            ws = attn.AttentionWorkspace.allocate(
                WS_ROWS, hq, d, torch.device(DEVICE), max_splits=WS_SPLITS
            )
            out = nan_like(p.q)
            attn.paged_attention(out=out, workspace=ws, **p.args(**opts))
            torch.cuda.synchronize()
            ok, detail = max_error(out, p, **opts)
        except Exception as e:  # noqa: BLE001 - a crash is a failure, reported like one
            ok, detail = False, repr(e)
            traceback.print_exc()
        print(f"{'PASS' if ok else 'FAIL'} check {name}: {detail}", flush=True)
        if not ok:
            all_ok = False
            run.peers.note(f"check FAILED: {name}: {detail}")
    return all_ok


# ----------------------------------------------------------------------------------------------
# 3. Timed sections
# ----------------------------------------------------------------------------------------------


def verify(
    run: Runner, label: str, fn: Callable[[], object], out: torch.Tensor, expected: Expected
) -> bool | None:
    """Run fn into a NaN `out` and compare with the reference's output (None: it did not run).

    A peer whose output differs is still timed (noted); fuselane is timed only if it matches.
    """
    out.fill_(float("nan"))
    if not try_run(run.peers, label, fn):
        return None
    ok, detail = expected.check(out)
    print(f"  {'ok' if ok else 'WRONG'} {label}: {detail}", flush=True)
    if not ok:
        run.peers.note(f"{label}: output differs from the reference: {detail}")
    return ok


def decode_bytes(p: Problem) -> int:
    kv = sum(p.lens) * HKV * D * 2 * p.kv.element_size()
    return kv + 2 * p.q.numel() * p.q.element_size()


def recheck(run: Runner, label: str, out: torch.Tensor, expected: Expected) -> None:
    """Compare `out` again after timing: it holds the last graph replay's output, so a race
    (e.g. in the fused split merge) or a counter left non-zero shows up here."""
    ok, detail = expected.check(out)
    if not ok:
        print(f"  WRONG after replays {label}: {detail}", flush=True)
        run.peers.note(f"{label}: output after graph replays differs from the reference: {detail}")


def time_flashinfer_decode(
    run: Runner, section: str, case: str, p: Problem, expected: Expected, nbytes: int
) -> None:
    """FlashInfer's paged decode on the same problem, checked then timed (if it imports)."""
    if run.peers.flashinfer is None:
        return
    o = nan_like(p.q)
    try:
        f = run.peers.fi_decode_fn(p, o)
    except Exception as e:  # noqa: BLE001
        run.peers.note(f"{section} {case} flashinfer plan failed: {e!r}")
        return
    if verify(run, f"{section} {case} flashinfer", f, o, expected) is not None:
        run.time(section, case, "flashinfer", f, nbytes=nbytes)


def bench_decode(run: Runner, pool, batch: int, ctx: int, ok: bool, gen, sweeps: dict) -> None:
    """Time one decode case; queue its sweep (run after every case) in `sweeps`."""
    section, case = "decode", decode_case(batch, ctx)
    p = make_problem([1] * batch, [ctx] * batch, gen, kv=pool)
    nbytes = decode_bytes(p)
    expected = Expected(p)
    out = nan_like(p.q)
    plan = default_plan(p, run)
    fn = fuselane_fn(run, p, out)
    if not ok:
        run.peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")
    elif verify(run, f"{section} {case} fuselane", fn, out, expected):
        run.time(section, case, "fuselane", fn, nbytes=nbytes, extra=plan_extra(plan))
        recheck(run, f"{section} {case} fuselane", out, expected)
    peers = run.peers
    if peers.vllm is not None:
        o = nan_like(p.q)
        f = peers.vllm_fn(p, o)
        if verify(run, f"{section} {case} vllm", f, o, expected) is not None:
            run.time(section, case, "vllm-triton-unified", f, nbytes=nbytes)
    time_flashinfer_decode(run, section, case, p, expected, nbytes)
    if ok:
        sweeps[("decode", batch)] = lambda: bench_decode_sweep(run, p, plan, nbytes, expected)


def decode_label(dec: attn.DecodeConfig) -> str:
    flags = (
        ("" if dec.fused_reduce or dec.num_splits == 1 else ",unfused")
        + (",head_fast" if dec.head_fast else "")
        + (",ws" if dec.warp_specialized else "")
    )
    return (
        f"fuselane[tile={dec.tile_n},w={dec.num_warps},s={dec.num_stages},"
        f"splits={dec.num_splits}{flags}]"
    )


def bench_decode_sweep(run: Runner, p: Problem, plan, nbytes: int, expected: Expected) -> None:
    section, case = "decode_sweep", decode_case(len(p.lens), p.lens[0])
    out = nan_like(p.q)
    run.time(section, case, "fuselane", fuselane_fn(run, p, out), nbytes=nbytes,
             extra=plan_extra(plan))  # fmt: skip
    changes = DECODE_SWEEP.get(len(p.lens), DECODE_SWEEP_LARGE_B)
    # Changes apply to the Triton kernel's plan, or (warp_specialized=True) to the
    # warp-specialized kernel's: the rule's, if it took that kernel.
    triton = default_plan(p, run, warp_specialized=False).decode
    ws_base = plan.decode if plan.decode.warp_specialized else dataclasses.replace(
        triton, block_m=attn.DECODE_WS_ROWS, max_q=0, head_fast=False, warp_specialized=True
    )  # fmt: skip
    points = []
    for change in changes:
        base = ws_base if change.get("warp_specialized") else triton
        dec = dataclasses.replace(base, **change)
        if dec != plan.decode and dec not in points:
            points.append(dec)
    for dec in points:
        if run.elapsed() > BUDGET_S:
            run.peers.note(f"{section}: time budget spent, rest of the sweep skipped")
            return
        label = decode_label(dec)
        sweep_plan = dataclasses.replace(plan, decode=dec)
        fn = fuselane_fn(run, p, out, sweep_plan)
        if verify(run, f"{section} {case} {label}", fn, out, expected):
            run.time(section, case, label, fn, nbytes=nbytes, extra=plan_extra(sweep_plan))
            recheck(run, f"{section} {case} {label}", out, expected)


def other_regime(run: Runner, plan: attn.LaunchPlan, p: Problem) -> attn.DecodeConfig:
    """The decode config of the schedule the rule did not pick (3 stages + two programs per SM
    <-> 5 stages + one, each with its own split count; `attn.decode_schedules`)."""
    dec = plan.decode
    schedules = attn.decode_schedules(
        len(p.lens), p.q.shape[1], p.kv.shape[3], p.q.shape[2], dec.qpos,
        attn.sm_count(p.q.device), attn.split_room(run.workspace), p.kv.element_size(),
    )  # fmt: skip
    _, stages, splits = next(sch for sch in schedules if sch[1] != dec.num_stages)
    return dataclasses.replace(dec, num_stages=stages, num_splits=splits,
                               head_fast=stages == attn.DECODE_STAGES)  # fmt: skip


def bench_decode_rule(run: Runner, pool, ok: bool, gen) -> None:
    """Batches where the rule switches regime: the rule's plan, the other regime's, FlashInfer."""
    if not ok:
        return
    section, ctx = "decode_rule", 4096
    for batch in DECODE_RULE_BATCHES:
        case = decode_case(batch, ctx)
        p = make_problem([1] * batch, [ctx] * batch, gen, kv=pool)
        nbytes = decode_bytes(p)
        expected = Expected(p)
        out = nan_like(p.q)
        plan = default_plan(p, run)
        fn = fuselane_fn(run, p, out)
        if verify(run, f"{section} {case} fuselane", fn, out, expected):
            run.time(section, case, "fuselane", fn, nbytes=nbytes, extra=plan_extra(plan))
        if plan.decode.warp_specialized:  # the Triton kernel's plan
            alt = default_plan(p, run, warp_specialized=False)
        else:
            alt = dataclasses.replace(plan, decode=other_regime(run, plan, p))
        label = decode_label(alt.decode)
        fn = fuselane_fn(run, p, out, alt)
        if verify(run, f"{section} {case} {label}", fn, out, expected):
            run.time(section, case, label, fn, nbytes=nbytes, extra=plan_extra(alt))
        time_flashinfer_decode(run, section, case, p, expected, nbytes)


def bench_prefill(run: Runner, pool, seq: int, ok: bool, gen, sweeps: dict) -> None:
    """Time one prefill case; queue its sweep (run after every case) in `sweeps`."""
    section, case = "prefill", prefill_case(seq)
    p = make_problem([seq], [seq], gen, kv=pool)
    flops = 2.0 * seq * seq * HQ * D
    expected = Expected(p, prefill=True)
    out = nan_like(p.q)
    plan = default_plan(p, run)
    fn = fuselane_fn(run, p, out)
    cold_l2: dict[str, Callable[[], object]] = {}
    if not ok:
        run.peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")
    elif verify(run, f"{section} {case} fuselane", fn, out, expected):
        run.time(section, case, "fuselane", fn, flops=flops, extra=plan_extra(plan))
        if seq == ENGINE_LAYOUT_SEQ:
            bench_prefill_engine_layout(run, p, section, case, flops, expected)
            cold_l2["fuselane"] = fn
    peers = run.peers
    if peers.flashinfer is not None:
        o = nan_like(p.q)
        try:
            f = peers.fi_prefill_fn(p, o)
        except Exception as e:  # noqa: BLE001
            peers.note(f"{section} {case} flashinfer plan failed: {e!r}")
        else:
            if verify(run, f"{section} {case} flashinfer", f, o, expected) is not None:
                run.time(section, case, "flashinfer", f, flops=flops)
                if seq == ENGINE_LAYOUT_SEQ:
                    cold_l2["flashinfer"] = f
    # torch SDPA on dense MHA-expanded tensors [1, Hq, S, D]
    pages = p.block_table[0].long()
    k = p.key_cache[pages].reshape(-1, HKV, D)[:seq].repeat_interleave(HQ // HKV, dim=1)
    v = p.value_cache[pages].reshape(-1, HKV, D)[:seq].repeat_interleave(HQ // HKV, dim=1)
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (p.q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=SCALE
                )

        if try_run(peers, f"{section} {case} sdpa-{name}", sdpa):
            run.time(section, case, f"torch-sdpa-{name}", sdpa, flops=flops,
                     extra={"layout": "dense, MHA-expanded"})  # fmt: skip
    if peers.vllm is not None:
        o = nan_like(p.q)
        f = peers.vllm_fn(p, o)
        if verify(run, f"{section} {case} vllm", f, o, expected) is not None:
            run.time(section, case, "vllm-triton-unified", f, flops=flops)
    if cold_l2:
        try:
            bench_prefill_cold_l2(run, case, flops, cold_l2)
        except Exception as e:  # noqa: BLE001 - a diagnostic row; the case's rows stand
            peers.note(f"prefill_cold_l2 {case}: failed: {e!r}")
            torch.cuda.synchronize()
    if ok:
        sweeps[("prefill", seq)] = lambda: bench_prefill_sweep(run, p, plan, flops, expected)


def bench_prefill_engine_layout(
    run: Runner, p: Problem, section: str, case: str, flops: float, expected: Expected
) -> None:
    """The same prefill on the tensors as vLLM's engine hands them over: the cache as one
    [pages, page, Hkv, 2 * D] tensor (each head's K row, then its V row) and q a view of a fused
    QKV projection output (row stride (Hq + 2 Hkv) * D). Same values, so the same check."""
    tokens = p.q.shape[0]
    cache = torch.cat([p.kv[:, 0], p.kv[:, 1]], dim=-1)  # [pages, page, Hkv, 2D]
    qkv = torch.empty(tokens, (HQ + 2 * HKV) * D, device=DEVICE, dtype=p.q.dtype)
    qkv[:, : HQ * D] = p.q.reshape(tokens, HQ * D)
    args = dict(p.args(), q=qkv[:, : HQ * D].view(tokens, HQ, D), key_cache=cache[..., :D],
                value_cache=cache[..., D:])  # fmt: skip
    out = nan_like(p.q)

    def fn():
        attn.paged_attention(out=out, workspace=run.workspace, **args)

    label = "fuselane (vLLM's tensors: K|V per head, q in qkv)"
    if verify(run, f"{section} {case} {label}", fn, out, expected):
        run.time(section, case, label, fn, flops=flops)


def bench_prefill_cold_l2(
    run: Runner, case: str, flops: float, fns: dict[str, Callable[[], object]]
) -> None:
    """Each of `fns` (already checked) timed with the L2 cache flushed before every call, as in
    the engine, where every layer reads its own K/V: the graph writes L2_FLUSH_BYTES before
    each call, and the flush's own time (measured alone, same way) is subtracted."""
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
    flush_ms = harness.time_graph(flush.zero_, calls_per_graph=5, reps=20)
    for impl, fn in fns.items():

        def flushed(fn=fn):
            flush.zero_()
            fn()

        ms = harness.time_graph(flushed, calls_per_graph=5, reps=20) - flush_ms
        row = run.report.add(harness.Row("prefill_cold_l2", case, impl, ms, None, flops,
                                         {"flush_us": round(flush_ms * 1e3, 2)}))  # fmt: skip
        print(f"  prefill_cold_l2 {case:<44} {impl:<20} {ms * 1e3:10.2f} us "
              f"{row.tflops:7.1f} TFLOP/s (flush {flush_ms * 1e3:.1f} us subtracted)",
              flush=True)  # fmt: skip


def bench_prefill_sweep(run: Runner, p: Problem, plan, flops: float, expected: Expected) -> None:
    section, case = "prefill_sweep", prefill_case(p.lens[0])
    out = nan_like(p.q)
    run.time(section, case, "fuselane", fuselane_fn(run, p, out), flops=flops,
             extra=plan_extra(plan))  # fmt: skip
    for bm, bn, w, s, head_fast, *ws in PREFILL_SWEEP:
        if run.elapsed() > BUDGET_S:
            run.peers.note(f"{section}: time budget spent, rest of the sweep skipped")
            return
        pre = dataclasses.replace(plan.prefill, block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                  head_fast=head_fast, warp_specialized=bool(ws))  # fmt: skip
        if pre == plan.prefill:
            continue
        sweep_plan = dataclasses.replace(plan, prefill=pre)
        flags = (",head_fast" if head_fast else "") + (",ws" if ws else "")
        label = f"fuselane[{bm}x{bn},w={w},s={s}{flags}]"
        fn = fuselane_fn(run, p, out, sweep_plan)
        if verify(run, f"{section} {case} {label}", fn, out, expected):
            run.time(section, case, label, fn, flops=flops, extra=plan_extra(sweep_plan))


def bench_mixed(run: Runner, pool, ok: bool, gen) -> None:
    section, case = "mixed", MIXED_CASE
    q_lens = [1] * MIXED_DECODES + [MIXED_CHUNK] * MIXED_CHUNKS
    p = make_problem(q_lens, [MIXED_SEQ_LEN] * len(q_lens), gen, kv=pool)
    # causal work: each chunk row sees (seq_len - chunk + i + 1) keys; each decode row seq_len
    ctx = MIXED_SEQ_LEN - MIXED_CHUNK
    pairs = MIXED_CHUNKS * (MIXED_CHUNK * ctx + MIXED_CHUNK * (MIXED_CHUNK + 1) // 2)
    flops = 4.0 * HQ * D * (pairs + MIXED_DECODES * MIXED_SEQ_LEN)
    expected = Expected(p)
    out = nan_like(p.q)
    plan = default_plan(p, run)
    fn = fuselane_fn(run, p, out)
    if not ok:
        run.peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")
    elif verify(run, f"{section} {case} fuselane", fn, out, expected):
        run.time(section, case, "fuselane", fn, flops=flops, extra=plan_extra(plan))
    peers = run.peers
    if peers.vllm is not None:
        o = nan_like(p.q)
        f = peers.vllm_fn(p, o)
        if verify(run, f"{section} {case} vllm", f, o, expected) is not None:
            run.time(section, case, "vllm-triton-unified", f, flops=flops)
    if peers.flashinfer is not None:
        o = nan_like(p.q)
        try:
            f = peers.fi_prefill_fn(p, o)
        except Exception as e:  # noqa: BLE001
            peers.note(f"{section} {case} flashinfer plan failed: {e!r}")
        else:
            if verify(run, f"{section} {case} flashinfer", f, o, expected) is not None:
                run.time(section, case, "flashinfer", f, flops=flops)


def run_sweeps(run: Runner, sweeps: dict) -> None:
    """The queued sweeps in SWEEP_ORDER (then any other); one failing sweep skips only itself."""
    order = [key for key in SWEEP_ORDER if key in sweeps]
    order += [key for key in sweeps if key not in order]
    for key in order:
        try:
            sweeps[key]()
        except Exception as e:  # noqa: BLE001 - keep the other sweeps
            run.peers.note(f"sweep {key} failed: {e!r}")
            traceback.print_exc()
            torch.cuda.synchronize()
        print(f"  [{run.elapsed():.0f} s] sweep {key[0]} {key[1]} done", flush=True)


# ----------------------------------------------------------------------------------------------
# 5. Goals
# ----------------------------------------------------------------------------------------------


def goals(report: harness.Report) -> list[str]:
    rows = report.as_dicts()

    def find(section, case, impl):
        return next(
            (r for r in rows if (r["section"], r["case"], r["impl"]) == (section, case, impl)), None
        )

    lines = []

    def goal(name: str, ok: bool | None, detail: str) -> None:
        word = "n/a " if ok is None else ("PASS" if ok else "MISS")
        lines.append(f"GOAL {word} {name}: {detail}")

    def vs_peers(section: str, case: str) -> None:
        peers = [
            r for r in rows
            if r["section"] == section and r["case"] == case and r["impl"] != "fuselane"
            and r["impl"].startswith(("vllm", "flashinfer"))
        ]  # fmt: skip
        slowest = min((r["peer_over_fuselane"] for r in peers), default=None)
        goal(
            f"{section} {case} faster than vLLM and FlashInfer",
            None if slowest is None else slowest > 1.0,
            ", ".join(f"{r['impl']} {r['us']} us = {r['peer_over_fuselane']}x" for r in peers)
            or "no peer ran",
        )

    for batch, ctx in DECODE_CASES:
        case = decode_case(batch, ctx)
        ours = find("decode", case, "fuselane")
        if ours is None:
            goal(f"decode {case}", None, "fuselane not timed")
            continue
        vs_peers("decode", case)
        if batch >= 16:
            pct = ours.get("pct_copy_ceiling")
            goal(
                f"decode {case} >= {GOAL_PCT_COPY}% of copy bandwidth",
                pct is not None and pct >= GOAL_PCT_COPY,
                f"{ours.get('TBps')} TB/s = {pct}%",
            )
        if batch == 1:
            goal(f"decode {case} >= {GOAL_B1_TBPS} TB/s", ours["TBps"] >= GOAL_B1_TBPS,
                 f"{ours['TBps']} TB/s ({ours['us']} us)")  # fmt: skip
    for seq in PREFILL_LENS:
        case = prefill_case(seq)
        ours = find("prefill", case, "fuselane")
        if ours is None:
            goal(f"prefill {case}", None, "fuselane not timed")
            continue
        for impl, need in (
            ("torch-sdpa-flash", GOAL_OVER_SDPA),
            ("flashinfer", GOAL_OVER_FI_PREFILL),
        ):
            peer = find("prefill", case, impl)
            if peer is None:
                goal(f"prefill {case} >= {need}x {impl}", None, "peer not timed")
                continue
            ratio = peer["us"] / ours["us"]  # same FLOPs: the TFLOP/s ratio
            goal(f"prefill {case} >= {need}x {impl}", ratio >= need,
                 f"{ours['TFLOPs']} vs {peer['TFLOPs']} TFLOP/s = {ratio:.2f}x")  # fmt: skip
    ours = find("mixed", MIXED_CASE, "fuselane")
    vllm = find("mixed", MIXED_CASE, "vllm-triton-unified")
    if ours is None or vllm is None:
        goal(f"mixed {MIXED_CASE} faster than vLLM unified", None, "not timed")
    else:
        goal(f"mixed {MIXED_CASE} faster than vLLM unified", vllm["peer_over_fuselane"] > 1.0,
             f"{ours['us']} us vs {vllm['us']} us = {vllm['peer_over_fuselane']}x")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON result")
    parser.add_argument("--quick", action="store_true", help="B=1, B=64, S=4096, mixed; no sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the config sweeps")
    parser.add_argument(
        "--prefill-only", action="store_true", help="the prefill cases and their sweeps only"
    )
    parser.add_argument(
        "--decode-only", action="store_true", help="the decode cases and their sweeps only"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    report = harness.Report("attention")
    print(f"device: {report.info}", flush=True)

    copy_tbps = harness.copy_ceiling_tbps()
    gemm_tflops = harness.gemm_ceiling_tflops()
    empty_us = harness.empty_kernel_ms() * 1e3
    report.ceilings = {
        "copy_tbps": round(copy_tbps, 3),
        "gemm_tflops": round(gemm_tflops, 1),
        "empty_kernel_us": round(empty_us, 3),
    }
    print(f"ceiling: copy {copy_tbps:.3f} TB/s, bf16 gemm {gemm_tflops:.1f} TFLOP/s, "
          f"empty Triton kernel {empty_us:.3f} us", flush=True)  # fmt: skip

    run = Runner(report, t_start)
    ok = run_checks(run)
    print(f"checks done at {run.elapsed():.0f} s (all {'PASS' if ok else 'NOT PASS'})", flush=True)

    decode_cases = [(1, 32768), (64, 4096)] if args.quick else DECODE_CASES
    decode_cases = [] if args.prefill_only else decode_cases
    prefill_lens = () if args.decode_only else (4096,) if args.quick else PREFILL_LENS
    pool = make_pool(POOL_PAGES, PAGE, HKV, D, DTYPE)
    print(f"KV pool: {pool.numel() * pool.element_size() / 1e9:.2f} GB", flush=True)
    sweeps: dict[tuple[str, int], Callable[[], None]] = {}
    sections = [
        lambda b=b, c=c: bench_decode(run, pool, b, c, ok, gen, sweeps) for b, c in decode_cases
    ]
    sections += [lambda s=s: bench_prefill(run, pool, s, ok, gen, sweeps) for s in prefill_lens]
    if not (args.prefill_only or args.decode_only):
        sections.append(lambda: bench_mixed(run, pool, ok, gen))
    if not (args.quick or args.no_sweep or args.prefill_only or args.decode_only):
        sections.append(lambda: bench_decode_rule(run, pool, ok, gen))
    # the sweeps last: the time budget may cut them, never a goal case
    if not (args.quick or args.no_sweep):
        sections.append(lambda: run_sweeps(run, sweeps))
    for section in sections:
        try:
            section()
        except Exception as e:  # noqa: BLE001 - keep the rest of the run and the JSON
            run.peers.note(f"section failed: {e!r}")
            traceback.print_exc()
            torch.cuda.synchronize()
        print(f"  [{run.elapsed():.0f} s]", flush=True)

    try:
        goal_lines = goals(report)
    except Exception as e:  # noqa: BLE001 - the JSON is written whatever happens here
        traceback.print_exc()
        goal_lines = [f"goal evaluation failed: {e!r}"]
    report.notes.extend(goal_lines)
    print("\n".join(goal_lines))
    for out in (args.out, None):
        print(f"wrote {report.write(out)}")
    print(f"total {run.elapsed():.0f} s")
    print(report.table())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

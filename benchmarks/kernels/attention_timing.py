"""The attention script's timing (bench_attention): the peers' calls, the runner that times and
records a call, fuselane's calls at the launch rule's plan or another, and the check of an
output before (and after) it is timed.

Peers: vLLM's `unified_attention` (TRITON_ATTN's kernel, with its 3-D split scratch sized as
triton_attn.py does), FlashInfer's BatchDecodeWithPagedKVCacheWrapper (tensor cores) and
BatchPrefillWithPagedKVCacheWrapper (plan() outside the timed region). Every call is timed by
CUDA-graph replay (eagerly, and noted, if it cannot be captured).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.attention_workload import (
    DTYPE,
    HKV,
    HQ,
    PAGE,
    SCALE,
    WS_ROWS,
    WS_SPLITS,
    D,
    Expected,
    Problem,
)
from fuselane.benchmarks.kernels.peers import (
    FI_WORKSPACE_BYTES,
    FLASHINFER,
    UNIFIED_ATTENTION,
    import_peer,
)
from fuselane.kernels import attention as attn

# vLLM TRITON_ATTN (triton_attn.py): MIN_LAUNCH_GRID_SIZE_2D and NUM_PAR_SOFTMAX_SEGMENTS
VLLM_MIN_GRID_2D, VLLM_SEGMENTS = 128, 16


@dataclass
class VllmScratch:
    """vLLM TRITON_ATTN's scratch for its 3-D (split) path: batches of up to `rows` sequences
    (seq_threshold_3D) split each sequence's keys into VLLM_SEGMENTS segments."""

    rows: int
    out: torch.Tensor
    max: torch.Tensor
    expsum: torch.Tensor

    @classmethod
    def allocate(
        cls, num_q_heads: int, num_kv_heads: int, head_size: int, device: torch.device | str
    ) -> VllmScratch:
        """Sized as TritonAttentionMetadataBuilder sizes it for these heads."""
        rows = VLLM_MIN_GRID_2D // num_kv_heads
        shape = (rows, num_q_heads, VLLM_SEGMENTS)
        f32 = dict(dtype=torch.float32, device=device)
        out = torch.empty(*shape, triton.next_power_of_2(head_size), **f32)
        return cls(rows, out, torch.empty(*shape, **f32), torch.empty(*shape, **f32))


def vllm_attention(
    unified_attention: Callable[..., object],
    p: Problem,
    out: torch.Tensor,
    scratch: VllmScratch,
    *,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0,
) -> Callable[[], object]:
    """vLLM's `unified_attention` on `p` into `out`, called as TRITON_ATTN calls it (causal; the
    k/v descales are layer._k_scale.expand(...): 1 for a bf16 cache, `p`'s per-tensor scales
    for an fp8 one, with vLLM's FP8_PER_TENSOR quantization mode where the kernel takes one)."""
    one = torch.ones((), dtype=torch.float32, device=out.device)
    shape = (len(p.lens), p.kv.shape[3])
    k_descale = (one if p.k_scale is None else p.k_scale.reshape(())).expand(shape)
    v_descale = (one if p.v_scale is None else p.v_scale.reshape(())).expand(shape)
    quant = vllm_fp8_mode(unified_attention) if p.kv.dtype == aw.FP8 else {}

    def fn() -> None:
        unified_attention(
            q=p.q,
            k=p.key_cache,
            v=p.value_cache,
            out=out,
            cu_seqlens_q=p.cu,
            max_seqlen_q=max(p.q_lens),
            seqused_k=p.seq_lens,
            max_seqlen_k=max(p.lens),
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=p.block_table,
            softcap=softcap,
            q_descale=None,
            k_descale=k_descale,
            v_descale=v_descale,
            seq_threshold_3D=scratch.rows,
            num_par_softmax_segments=VLLM_SEGMENTS,
            softmax_segm_output=scratch.out,
            softmax_segm_max=scratch.max,
            softmax_segm_expsum=scratch.expsum,
            **quant,
        )

    return fn


def vllm_fp8_mode(unified_attention: Callable[..., object]) -> dict[str, object]:
    """The keyword that makes `unified_attention` dequantize an fp8 cache with per-tensor
    scales. vLLM versions whose kernel takes `kv_quant_mode` (0.26 and 0.33 among them) only
    cast an fp8 cache, unscaled, without FP8_PER_TENSOR; older ones dequantize whenever the
    cache is fp8 and take no such argument. The enum is the kernel module's own (no import of
    vLLM's internals here)."""
    if "kv_quant_mode" not in inspect.signature(unified_attention).parameters:
        return {}
    enum = getattr(inspect.getmodule(unified_attention), "KVQuantMode", None)
    return {"kv_quant_mode": enum.FP8_PER_TENSOR if enum is not None else 1}


class Peers(family_script.ScriptPeers):
    """vLLM's and FlashInfer's attention, where they import, and the script's notes."""

    def __init__(self, report: harness.Report) -> None:
        super().__init__(report)
        self.vllm: Callable | None = import_peer(UNIFIED_ATTENTION, self.note)
        self.flashinfer = import_peer(FLASHINFER, self.note)
        self.fi_workspace: torch.Tensor | None = None
        if self.flashinfer is not None:
            self.fi_workspace = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=aw.DEVICE)
        self.vllm_scratch = VllmScratch.allocate(HQ, HKV, D, aw.DEVICE)

    def vllm_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        return vllm_attention(self.vllm, p, out, self.vllm_scratch, scale=SCALE)

    def fi_decode_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.fi_workspace, "NHD", use_tensor_cores=True
        )
        pages = (p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        wrapper.plan(
            *pages, HQ, HKV, D, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=SCALE
        )
        return lambda: wrapper.run(p.q, p.kv, out=out)

    def fi_prefill_fn(self, p: Problem, out: torch.Tensor) -> Callable[[], object]:
        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.fi_workspace, "NHD")
        pages = (p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        options = dict(causal=True, sm_scale=SCALE, q_data_type=DTYPE, kv_data_type=DTYPE)
        wrapper.plan(p.cu, *pages, HQ, HKV, D, PAGE, **options)
        return lambda: wrapper.run(p.q, p.kv, out=out)


class Runner(family_script.ScriptRunner):
    """The attention script's timing (graph replay, loop sized per call), its peers and the
    split-KV workspace of every fuselane call."""

    def __init__(self, report: harness.Report, t_start: float) -> None:
        super().__init__(report, t_start)
        self.peers = Peers(report)
        self.workspace = attn.AttentionWorkspace.allocate(
            WS_ROWS, HQ, D, torch.device(aw.DEVICE), max_splits=WS_SPLITS
        )

    def note(self, text: str) -> None:
        self.peers.note(text)


def fuselane_fn(
    run: Runner, p: Problem, out: torch.Tensor, plan: attn.LaunchPlan | None = None
) -> Callable[[], object]:
    """fuselane's call on `p` into `out`: `paged_attention` (the launch rule's plan), or with
    `plan` the same launch code at that plan."""
    args = p.args()
    if plan is None:
        return lambda: attn.paged_attention(out=out, workspace=run.workspace, **args)
    a = args
    batch = attn.PagedBatch(a["cu_seqlens_q"], a["seq_lens"], a["block_table"], a["max_query_len"])
    options = attn.AttentionOptions(a["scale"], k_scale=a["k_scale"], v_scale=a["v_scale"])

    def fn():  # a sweep point: the same launch code with another config
        attn.run._run(a["q"], a["key_cache"], a["value_cache"], out, batch, options,
                      run.workspace, plan=plan)  # fmt: skip

    return fn


def default_plan(p: Problem, run: Runner, warp_specialized: bool | None = None) -> attn.LaunchPlan:
    """The launch rule's plan for `p` (warp_specialized: None = as `paged_attention` decides)."""
    if warp_specialized is None:
        warp_specialized = attn.warp_specialized_ok(p.q, p.key_cache, p.value_cache)
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
        "decode": f"splits={d.num_splits} budget={d.split_budget} tile={d.tile_n} "
        f"w={d.num_warps} s={d.num_stages} "
        f"fused={d.fused_reduce} head_fast={d.head_fast} ws={d.warp_specialized}"
    }
    if plan.prefill is not None:
        f = plan.prefill
        extra["prefill"] = (
            f"{f.block_m}x{f.block_n} w={f.num_warps} s={f.num_stages} head_fast={f.head_fast}"
            f" ws={f.warp_specialized}"
        )
    return extra


def verify(
    run: Runner, label: str, fn: Callable[[], object], out: torch.Tensor, expected: Expected
) -> bool | None:
    """Run fn into a NaN `out` and compare with the reference's output (None: it did not run).

    A peer whose output differs is still timed (noted); fuselane is timed only if it matches.
    """
    out.fill_(float("nan"))
    if not family_script.try_run(run.peers.note, label, fn):
        return None
    ok, detail = expected.check(out)
    print(f"  {'ok' if ok else 'WRONG'} {label}: {detail}", flush=True)
    if not ok:
        run.peers.note(f"{label}: output differs from the reference: {detail}")
    return ok


def recheck(run: Runner, label: str, out: torch.Tensor, expected: Expected) -> None:
    """Compare `out` again after timing: it holds the last graph replay's output, so a race
    (e.g. in the fused split merge) or a counter left non-zero shows up here."""
    ok, detail = expected.check(out)
    if not ok:
        print(f"  WRONG after replays {label}: {detail}", flush=True)
        run.peers.note(f"{label}: output after graph replays differs from the reference: {detail}")


def time_checked(
    run: Runner,
    section: str,
    case: str,
    impl: str,
    fn: Callable[[], object],
    out: torch.Tensor,
    expected: Expected,
    plan: attn.LaunchPlan,
    **rate: float,
) -> bool:
    """A fuselane call (`impl`: its row's name) checked on the timed inputs, then timed, its plan
    in the row; False if it did not run or its output differs (noted). rate: nbytes or flops."""
    if not verify(run, f"{section} {case} {impl}", fn, out, expected):
        return False
    run.time(section, case, impl, fn, extra=plan_extra(plan), **rate)
    return True


class RuleCall(NamedTuple):
    """fuselane on a problem at the launch rule's plan: its output buffer, the plan, the call,
    and whether it was timed."""

    out: torch.Tensor
    plan: attn.LaunchPlan
    fn: Callable[[], object]
    timed: bool


def time_rule(
    run: Runner,
    section: str,
    case: str,
    p: Problem,
    expected: Expected,
    ok: bool,
    **rate: float,
) -> RuleCall:
    """fuselane at the launch rule's plan on `p`, checked on these inputs then timed; not timed
    (noted) where the broad GPU check failed (`ok` False). rate: nbytes or flops."""
    out = aw.nan_like(p.q)
    plan = default_plan(p, run)
    fn = fuselane_fn(run, p, out)
    if not ok:
        run.peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")
        return RuleCall(out, plan, fn, False)
    timed = time_checked(run, section, case, "fuselane", fn, out, expected, plan, **rate)
    return RuleCall(out, plan, fn, timed)


def time_vllm(
    run: Runner, section: str, case: str, p: Problem, expected: Expected, **rate: float
) -> None:
    """vLLM's unified attention on the same problem, checked then timed (if it imports)."""
    if run.peers.vllm is None:
        return
    o = aw.nan_like(p.q)
    f = run.peers.vllm_fn(p, o)
    if verify(run, f"{section} {case} vllm", f, o, expected) is not None:
        run.time(section, case, "vllm-triton-unified", f, **rate)


def time_flashinfer(
    run: Runner,
    section: str,
    case: str,
    p: Problem,
    expected: Expected,
    decode: bool,
    **rate: float,
) -> Callable[[], object] | None:
    """FlashInfer's paged decode or prefill on the same problem, checked then timed (if it
    imports and plans it); the call, if it ran."""
    peers = run.peers
    if peers.flashinfer is None:
        return None
    o = aw.nan_like(p.q)
    try:
        f = (peers.fi_decode_fn if decode else peers.fi_prefill_fn)(p, o)
    except Exception as e:  # noqa: BLE001
        peers.note(f"{section} {case} flashinfer plan failed: {e!r}")
        return None
    if verify(run, f"{section} {case} flashinfer", f, o, expected) is None:
        return None
    run.time(section, case, "flashinfer", f, **rate)
    return f

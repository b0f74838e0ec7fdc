"""Launching a plan's kernels, and the start-up warm-up that compiles every reachable one."""

from __future__ import annotations

import torch

from . import hopper
from .args import AttentionOptions, PagedBatch
from .checks import _refuse_unrunnable_ws
from .decode import launch_decode
from .hopper import decode_warp_specialized_ok, warp_specialized_ok
from .plan import (
    AttentionWorkspace,
    LaunchPlan,
    plan_launch,
    reachable_plans,
    sm_count,
    smem_per_block,
)
from .prefill import launch_prefill


def warm_up(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    *,
    num_q_heads: int,
    q_dtype: torch.dtype,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None = None,
    strict: bool = False,
) -> int:
    """Compile (by launching once on a one-token batch) every kernel variant `paged_attention`
    can choose for these caches, heads and options; returns how many plans were launched.

    A Hopper kernel that fails to compile or launch here is switched off for the process
    (`disable_hopper_kernels`, the Triton kernels take its batches) and the warm-up goes on
    without it, unless `strict` (the caller asked for these kernels by name): then, as for a
    failure of a Triton kernel, the error propagates and start-up stops.

    For a serving engine's start-up, outside any CUDA-graph capture: a variant first met in the
    middle of serving stalls that step for the compile (seconds). Launch arguments share every
    property Triton specializes on with real calls: the real caches and workspace,
    `block_table_row` a [1, max_blocks] slice of the real block table (its row stride), fresh
    (aligned) q / out / offsets. Reads block `block_table_row[0, 0]` of the caches, writes only
    its own scratch output.
    """
    head_size = key_cache.shape[3]
    device = key_cache.device
    probe = torch.empty(0, num_q_heads, head_size, dtype=q_dtype, device=device)
    plans = reachable_plans(
        num_q_heads=num_q_heads, num_kv_heads=key_cache.shape[2], head_size=head_size,
        sms=sm_count(device), workspace=workspace, kv_bytes=key_cache.element_size(),
        max_smem=smem_per_block(device),
        warp_specialized=warp_specialized_ok(probe, key_cache, value_cache),
        decode_warp_specialized=decode_warp_specialized_ok(probe, key_cache, value_cache),
    )  # fmt: skip
    for plan in plans:
        q_len = plan.decode.qpos
        # Not zeros and a NaN output: outputs that tell a launch that ran from one that did
        # not (the start-up check of direct launches compares them).
        q = torch.ones(q_len, num_q_heads, head_size, dtype=q_dtype, device=device)
        out = torch.full_like(q, float("nan"))
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([q_len], dtype=torch.int32, device=device)
        batch = PagedBatch(cu, seq_lens, block_table_row, q_len)
        try:
            _run(q, key_cache, value_cache, out, batch, options, workspace, plan=plan)
        except Exception as e:
            if strict or not _uses_hopper_kernels(plan):
                raise
            hopper.disable_hopper_kernels(f"{type(e).__name__} at start-up: {e}"[:500])
            return warm_up(
                key_cache, value_cache, block_table_row, num_q_heads=num_q_heads,
                q_dtype=q_dtype, options=options, workspace=workspace,
            )  # fmt: skip
    return len(plans)


def _uses_hopper_kernels(plan: LaunchPlan) -> bool:
    return plan.decode.warp_specialized or (
        plan.prefill is not None and plan.prefill.warp_specialized
    )


def _skips_decode(plan: LaunchPlan, min_query_len: int, q: torch.Tensor) -> bool:
    """Whether this call can leave out the decode launch: its plan has a prefill launch and
    every non-empty sequence is longer than the decode kernel's positions (`min_query_len`,
    known on the host), so no program of the decode launch would find a row of its own. One
    launch fewer per layer on prefill steps, which vLLM runs eagerly. Never while a CUDA graph
    is captured: a replay may bring decode rows that the captured batch did not have."""
    if plan.prefill is None or min_query_len <= plan.prefill.min_q:
        return False
    return not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _run(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None,
    plan: LaunchPlan | None = None,
) -> None:
    """Launch the kernels of `plan` (default: `plan_launch` for these shapes). A given plan is
    for benchmark sweeps; its splits must fit the workspace."""
    num_seqs = batch.num_seqs
    if num_seqs == 0 or q.shape[0] == 0:
        return
    if plan is None:
        # Only the kernel this batch could take is asked about (the rule reads the decode flag
        # for batches of one query position alone, the prefill flag for the others): one Hopper
        # check per call, not two, on the path vLLM runs attention in eagerly.
        one_position = batch.max_query_len <= 1
        plan = plan_launch(
            num_seqs=num_seqs,
            num_q_heads=q.shape[1],
            num_kv_heads=key_cache.shape[2],
            head_size=q.shape[2],
            max_query_len=batch.max_query_len,
            sms=sm_count(q.device),
            workspace=workspace,
            kv_bytes=key_cache.element_size(),
            max_smem=smem_per_block(q.device),
            warp_specialized=not one_position and warp_specialized_ok(q, key_cache, value_cache),
            decode_warp_specialized=one_position
            and decode_warp_specialized_ok(q, key_cache, value_cache),
        )
    else:
        _refuse_unrunnable_ws(plan, q, key_cache, value_cache, batch, options)
    # Triton 3.6's interpreter mis-multiplies bf16 in tl.dot (see decode._mma); on
    # the CPU the kernels can only be running under it.
    upcast_dot = (q.device.type == "cpu" and q.dtype == torch.bfloat16) or q.dtype == torch.float32
    dec, pre = plan.decode, plan.prefill
    if dec.warp_specialized:
        hopper.decode_ws.launch_decode_ws(
            q, key_cache, value_cache, out, batch, options, workspace, dec
        )
    elif not _skips_decode(plan, batch.min_query_len, q):
        launch_decode(
            q, key_cache, value_cache, out, batch, options, workspace, dec, upcast_dot=upcast_dot
        )
    if pre is not None and pre.warp_specialized:
        hopper.prefill_ws.launch_prefill_ws(q, key_cache, value_cache, out, batch, options, pre)
    elif pre is not None:
        launch_prefill(q, key_cache, value_cache, out, batch, options, pre, upcast_dot=upcast_dot)

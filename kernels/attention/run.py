"""Launching a plan's kernels, and the start-up warm-up that compiles every reachable one."""

from __future__ import annotations

import torch

from . import hopper
from .checks import _refuse_unrunnable_ws
from .decode import launch_decode
from .hopper import warp_specialized_ok
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
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
    strict: bool = False,
) -> int:
    """Compile (by launching once on a one-token batch) every kernel variant `paged_attention`
    can choose for these caches and heads; returns how many plans were launched.

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
    window = 0 if sliding_window is None else sliding_window
    probe = torch.empty(0, num_q_heads, head_size, dtype=q_dtype, device=device)
    ws = warp_specialized_ok(probe, key_cache, value_cache, sliding_window=window,
                             softcap=softcap, has_sinks=sinks is not None)  # fmt: skip
    plans = reachable_plans(
        num_q_heads=num_q_heads, num_kv_heads=key_cache.shape[2], head_size=head_size,
        sms=sm_count(device), workspace=workspace, kv_bytes=key_cache.element_size(),
        max_smem=smem_per_block(device), warp_specialized=ws,
    )  # fmt: skip
    for plan in plans:
        q_len = plan.decode.qpos
        # Not zeros and a NaN output: outputs that tell a launch that ran from one that did
        # not (the start-up check of direct launches compares them).
        q = torch.ones(q_len, num_q_heads, head_size, dtype=q_dtype, device=device)
        out = torch.full_like(q, float("nan"))
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([q_len], dtype=torch.int32, device=device)
        try:
            _run(
                q, key_cache, value_cache, out, cu, seq_lens, block_table_row, q_len, scale,
                window, softcap, sinks, k_scale, v_scale, workspace, plan=plan,
            )  # fmt: skip
        except Exception as e:
            if strict or not _uses_hopper_kernels(plan):
                raise
            hopper.disable_hopper_kernels(f"{type(e).__name__} at start-up: {e}"[:500])
            return warm_up(
                key_cache, value_cache, block_table_row, num_q_heads=num_q_heads,
                q_dtype=q_dtype, scale=scale, sliding_window=sliding_window, softcap=softcap,
                sinks=sinks, k_scale=k_scale, v_scale=v_scale, workspace=workspace,
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
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    workspace: AttentionWorkspace | None,
    plan: LaunchPlan | None = None,
    min_query_len: int = 0,
) -> None:
    """Launch the kernels of `plan` (default: `plan_launch` for these shapes). A given plan is
    for benchmark sweeps; its splits must fit the workspace. `min_query_len` as in
    `paged_attention` (0: unknown)."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    if plan is None:
        plan = plan_launch(
            num_seqs=num_seqs,
            num_q_heads=q.shape[1],
            num_kv_heads=key_cache.shape[2],
            head_size=q.shape[2],
            max_query_len=max_query_len,
            sms=sm_count(q.device),
            workspace=workspace,
            kv_bytes=key_cache.element_size(),
            max_smem=smem_per_block(q.device),
            warp_specialized=warp_specialized_ok(
                q, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap,
                has_sinks=sinks is not None,
            ),
        )  # fmt: skip
    else:
        _refuse_unrunnable_ws(plan, q, key_cache, value_cache, max_query_len, sliding_window,
                              softcap, sinks is not None)  # fmt: skip
    # Triton 3.6's interpreter mis-multiplies bf16 in tl.dot (see decode._mma); on
    # the CPU the kernels can only be running under it.
    upcast_dot = (q.device.type == "cpu" and q.dtype == torch.bfloat16) or q.dtype == torch.float32
    dec = plan.decode
    if dec.warp_specialized:
        split = dec.num_splits > 1
        hopper.decode_ws.launch_decode_ws(
            q, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_table,
            workspace.partial_out if split else None, workspace.partial_ml if split else None,
            workspace.counters if split else None, scale=scale, tile_n=dec.tile_n,
            num_splits=dec.num_splits, num_buf=dec.num_stages, head_fast=dec.head_fast,
        )  # fmt: skip
    elif not _skips_decode(plan, min_query_len, q):
        launch_decode(
            q,
            key_cache,
            value_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_table,
            sinks,
            k_scale,
            v_scale,
            workspace.partial_out if workspace is not None else None,
            workspace.partial_ml if workspace is not None else None,
            workspace.counters if workspace is not None else None,
            scale=scale,
            softcap=softcap,
            sliding_window=sliding_window,
            qpos=dec.qpos,
            block_m=dec.block_m,
            tile_n=dec.tile_n,
            num_splits=dec.num_splits,
            fused_reduce=dec.fused_reduce,
            head_fast=dec.head_fast,
            max_q=dec.max_q,
            num_warps=dec.num_warps,
            num_stages=dec.num_stages,
            upcast_dot=upcast_dot,
        )
    if plan.prefill is not None and plan.prefill.warp_specialized:
        pre = plan.prefill
        hopper.prefill_ws.launch_prefill_ws(
            q, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_table, scale=scale,
            block_m=pre.block_m, block_n=pre.block_n, min_q=pre.min_q, head_fast=pre.head_fast,
            num_warps=pre.num_warps, num_buf=pre.num_stages,
        )  # fmt: skip
    elif plan.prefill is not None:
        pre = plan.prefill
        launch_prefill(
            q,
            key_cache,
            value_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_table,
            sinks,
            k_scale,
            v_scale,
            scale=scale,
            softcap=softcap,
            sliding_window=sliding_window,
            block_m=pre.block_m,
            block_n=pre.block_n,
            min_q=pre.min_q,
            head_fast=pre.head_fast,
            num_warps=pre.num_warps,
            num_stages=pre.num_stages,
            upcast_dot=upcast_dot,
        )

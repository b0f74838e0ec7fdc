"""Argument checks of the paged-attention entry points: host-side, never reading device data."""

from __future__ import annotations

import math

import torch

from .._checks import FP8_E4M3, check_choice, check_kernel_device, check_tensor
from . import hopper
from .args import AttentionOptions, PagedBatch
from .plan import (
    MAX_GQA_GROUP,
    MAX_GRID_YZ,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_Q_DTYPES,
    LaunchPlan,
)


def check_supported(
    *,
    head_size: int | None = None,
    block_size: int | None = None,
    q_dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    num_q_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> None:
    """Raise ValueError naming what is supported if any given property is not.

    For the plugin's capability hooks: pass whichever properties are known.
    """
    if head_size is not None:
        check_choice("head_size", head_size, SUPPORTED_HEAD_SIZES)
    if block_size is not None:
        check_choice("block_size", block_size, SUPPORTED_BLOCK_SIZES)
    if q_dtype is not None:
        check_choice("q dtype", q_dtype, SUPPORTED_Q_DTYPES)
    if kv_cache_dtype is not None:
        check_choice("kv_cache dtype", kv_cache_dtype, SUPPORTED_KV_CACHE_DTYPES)
    if num_q_heads is not None and num_kv_heads is not None:
        if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads: expected a positive multiple of num_kv_heads={num_kv_heads}, "
                f"got {num_q_heads}"
            )
        if num_q_heads // num_kv_heads > MAX_GQA_GROUP:
            raise ValueError(
                f"num_q_heads: expected at most {MAX_GQA_GROUP} query heads per kv head, got "
                f"{num_q_heads // num_kv_heads} ({num_q_heads} / {num_kv_heads})"
            )


def _check_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
) -> None:
    """Host-side checks (shapes, dtypes, devices, strides, scalars); never reads device data."""
    check_tensor("q", q, ndim=3, dtypes=SUPPORTED_Q_DTYPES, last_dim_contiguous=True)
    check_kernel_device("q", q)
    device = q.device
    num_tokens, num_q_heads, head_size = q.shape
    cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
    max_query_len, min_query_len = batch.max_query_len, batch.min_query_len
    scale, sliding_window, softcap = options.scale, options.sliding_window, options.softcap
    sinks, k_scale, v_scale = options.sinks, options.k_scale, options.v_scale
    check_tensor(
        "key_cache",
        key_cache,
        ndim=4,
        dtypes=(q.dtype, FP8_E4M3),
        device=device,
        last_dim_contiguous=True,
    )
    num_blocks, block_size, num_kv_heads, kv_head_size = key_cache.shape
    check_tensor(
        "value_cache",
        value_cache,
        shape=list(key_cache.shape),
        dtypes=(key_cache.dtype,),
        device=device,
        last_dim_contiguous=True,
    )
    if kv_head_size != head_size:
        raise ValueError(
            f"key_cache: expected head size {head_size} (q's last dimension), got {kv_head_size}"
        )
    check_supported(
        head_size=head_size,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
    )
    check_tensor(
        "out", out, shape=list(q.shape), dtypes=(q.dtype,), device=device, last_dim_contiguous=True
    )
    check_tensor(
        "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True
    )
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected shape [num_seqs + 1], got [0]")
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_tensor(
        "seq_lens",
        seq_lens,
        shape=[num_seqs],
        dtypes=(torch.int32,),
        device=device,
        contiguous=True,
    )
    check_tensor(
        "block_table",
        block_table,
        shape=[num_seqs, None],
        dtypes=(torch.int32,),
        device=device,
        last_dim_contiguous=True,
    )
    if num_seqs > MAX_GRID_YZ:
        raise ValueError(f"seq_lens: expected at most {MAX_GRID_YZ} sequences, got {num_seqs}")
    for name, value in (("max_query_len", max_query_len), ("max_seq_len", batch.max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    if (
        isinstance(min_query_len, bool)
        or not isinstance(min_query_len, int)
        or not 0 <= min_query_len <= max_query_len
    ):
        raise ValueError(
            f"min_query_len: expected an int in [0, max_query_len={max_query_len}] (0 = "
            f"unknown), got {min_query_len!r}"
        )
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"sliding_window: expected None or an int >= 1 (keys per query, itself included), "
            f"got {sliding_window!r}"
        )
    if sinks is not None:
        check_tensor("sinks", sinks, shape=[num_q_heads], dtypes=(torch.float32,), device=device)
    kv_fp8 = key_cache.dtype == FP8_E4M3
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            if kv_fp8:
                raise ValueError(f"{name}: required for a float8_e4m3fn KV cache, got None")
            continue
        check_tensor(name, t, dtypes=(torch.float32,), device=device)
        if t.numel() != 1:
            raise ValueError(f"{name}: expected one element (a per-tensor scale), got {t.shape}")
    del num_tokens, num_blocks


def _refuse_unrunnable_ws(
    plan: LaunchPlan,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
) -> None:
    """Raise if a given plan (benchmark sweeps, tests) names a Hopper kernel this call cannot
    run; the rule's own plans take them only where `warp_specialized_ok` (prefill) and
    `decode_warp_specialized_ok` said yes."""
    dec, pre = plan.decode, plan.prefill
    ws_prefill = pre is not None and pre.warp_specialized
    if not (dec.warp_specialized or ws_prefill):
        return
    sliding_window, softcap = options.window, options.softcap
    has_sinks = options.sinks is not None
    got = (
        f"got max_query_len {batch.max_query_len}, {q.device} {q.dtype} cache "
        f"{key_cache.dtype} head size {q.shape[2]}, window {sliding_window}, softcap {softcap}, "
        f"sinks {has_sinks}"
    )
    reason = hopper.hopper_kernels_off()
    off = "" if reason is None else f" (off in this process: {reason})"
    decode_ok = hopper.decode_warp_specialized_ok(q, key_cache, value_cache)
    if dec.warp_specialized and not (decode_ok and pre is None and dec.qpos == 1):
        raise ValueError(
            "paged_attention: the warp-specialized decode kernel runs decode-only batches "
            f"(query_len 1) on sm_90 GPUs{off}, fp16/bf16 with a cache of the same dtype or fp8 "
            f"e4m3, head sizes {hopper.DECODE_WS_HEAD_SIZES}; {got}"
        )
    if ws_prefill and not hopper.warp_specialized_ok(q, key_cache, value_cache):
        raise ValueError(
            f"paged_attention: the warp-specialized prefill kernel runs sm_90 GPUs{off}, "
            f"fp16/bf16 with a cache of the same dtype or fp8 e4m3, head sizes "
            f"{hopper.WS_HEAD_SIZES}; {got}"
        )

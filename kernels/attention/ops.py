"""The paged-attention entry points: the custom op (with its fake for torch.compile), the checked
call, and the unchecked call vLLM's layers after the first replay."""

from __future__ import annotations

import contextlib

import torch

from .._launch import LaunchCache, use_custom_op
from .checks import _check_args
from .plan import AttentionWorkspace
from .run import _run


@torch.library.custom_op(
    "fuselane::paged_attention",
    mutates_args=("out", "ws_partial_out", "ws_partial_ml", "ws_counters"),
)
def _paged_attention_op(
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
    ws_partial_out: torch.Tensor | None,
    ws_partial_ml: torch.Tensor | None,
    ws_counters: torch.Tensor | None,
    ws_max_num_tokens: int,
    ws_max_splits: int,
    min_query_len: int = 0,
) -> None:
    """torch.library form of `paged_attention` (the workspace passed as its three buffers)."""
    workspace = None
    if ws_partial_out is not None and ws_partial_ml is not None and ws_counters is not None:
        workspace = AttentionWorkspace(
            partial_out=ws_partial_out,
            partial_ml=ws_partial_ml,
            counters=ws_counters,
            max_num_tokens=ws_max_num_tokens,
            num_q_heads=q.shape[1],
            head_size=q.shape[2],
            max_splits=ws_max_splits,
        )
    _run(
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        max_query_len,
        scale,
        sliding_window,
        softcap,
        sinks,
        k_scale,
        v_scale,
        workspace,
        min_query_len=min_query_len,
    )


@_paged_attention_op.register_fake
def _paged_attention_fake(
    q,
    key_cache,
    value_cache,
    out,
    cu_seqlens_q,
    seq_lens,
    block_table,
    max_query_len,
    scale,
    sliding_window,
    softcap,
    sinks,
    k_scale,
    v_scale,
    ws_partial_out,
    ws_partial_ml,
    ws_counters,
    ws_max_num_tokens,
    ws_max_splits,
    min_query_len=0,
) -> None:
    return None


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    min_query_len: int = 0,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
) -> torch.Tensor:
    """Causal paged attention of a varlen batch (decode, prefill or mixed); writes and returns out.

    q:            [num_tokens, Hq, D] fp16/bf16
    key_cache:    [num_blocks, block_size, Hkv, D] q's dtype or float8_e4m3fn, last stride 1
    value_cache:  like key_cache
    out:          [num_tokens, Hq, D] q's dtype, written for rows < cu_seqlens_q[-1] only
    cu_seqlens_q: [num_seqs + 1] int32, query row offsets
    seq_lens:     [num_seqs] int32, KV length of each sequence including its query tokens
    block_table:  [num_seqs, max_blocks] int32, physical block of each logical block
    max_query_len: host int >= every query length: picks the decode-only path when <= 8
    min_query_len: host int, the shortest query among sequences with any, if the caller knows
                  it (vLLM does; 0 = unknown): a batch of prefill chunks only (all longer than
                  the decode kernel's positions) then skips the decode launch
    max_seq_len:  host int (accepted for vLLM parity; unused, see the module docstring)
    scale:        softmax scale (> 0)
    sliding_window: None, or W keys per query (itself included), vLLM's convention
    softcap:      0 = off, else logits become softcap * tanh(logit / softcap)
    sinks:        [Hq] fp32 sink logits, or None
    k_scale, v_scale: [1] fp32 per-tensor scales, required for an fp8 cache
    workspace:    split-KV scratch; None runs without splits (slower for small decode batches)

    No host sync and no allocation: safe inside CUDA graphs.
    """
    _check_args(
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        max_query_len,
        min_query_len,
        max_seq_len,
        scale,
        sliding_window,
        softcap,
        sinks,
        k_scale,
        v_scale,
    )
    if workspace is not None:
        if not isinstance(workspace, AttentionWorkspace):
            raise ValueError(
                f"workspace: expected an AttentionWorkspace, got {type(workspace).__name__}"
            )
        if workspace.partial_out.device != q.device:
            raise ValueError(
                f"workspace: expected device {q.device}, got {workspace.partial_out.device}"
            )
    window = 0 if sliding_window is None else sliding_window
    if use_custom_op(q):
        _paged_attention_op(
            q,
            key_cache,
            value_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_table,
            max_query_len,
            float(scale),
            window,
            float(softcap),
            sinks,
            k_scale,
            v_scale,
            workspace.partial_out if workspace is not None else None,
            workspace.partial_ml if workspace is not None else None,
            workspace.counters if workspace is not None else None,
            workspace.max_num_tokens if workspace is not None else 0,
            workspace.max_splits if workspace is not None else 0,
            min_query_len,
        )
    else:
        _run(
            q,
            key_cache,
            value_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_table,
            max_query_len,
            float(scale),
            window,
            float(softcap),
            sinks,
            k_scale,
            v_scale,
            workspace,
            min_query_len=min_query_len,
        )
    return out


# The unchecked entry point's recent launches: vLLM's layers after the first of a step replay
# the first one's (same metadata, shapes and options; their own q, caches and output).
LAUNCHES = LaunchCache()


def paged_attention_unchecked(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    min_query_len: int = 0,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None,
) -> torch.Tensor:
    """`paged_attention` (same arguments) without its argument checks, for eager callers that
    passed the same kind of arguments (dtypes, head counts, cache tensors, options) through
    `paged_attention` once: vLLM's backend, layer by layer, where host time per layer is step
    time on its eager path. Batch sizes may differ between calls; their consistency is the
    caller's contract.

    A call whose metadata tensors (the same objects), shapes, dtypes and options equal an
    earlier call's replays that call's launches with its own q, caches, output, sinks and
    scales (`LAUNCHES`, a `LaunchCache`): vLLM's layers after the first of each step."""
    if use_custom_op(q):  # traced: the checked custom-op path
        return paged_attention(
            q, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_table,
            max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
            min_query_len=min_query_len, sliding_window=sliding_window, softcap=softcap,
            sinks=sinks, k_scale=k_scale, v_scale=v_scale, workspace=workspace,
        )  # fmt: skip
    recording: contextlib.AbstractContextManager = contextlib.nullcontext()
    # A captured graph is replayed with other batches: its plan keeps the decode launch
    # (`_skips_decode`), which a recording made outside the capture may have left out.
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Everything a launch depends on besides the layer's own tensors (see LaunchCache).
        key = (
            id(cu_seqlens_q), id(seq_lens), id(block_table), id(workspace), q.shape,
            q.stride(), q.dtype, out.shape, out.stride(), out.dtype, key_cache.shape,
            key_cache.stride(), value_cache.shape, value_cache.stride(), key_cache.dtype,
            value_cache.dtype, max_query_len, min_query_len, scale, sliding_window, softcap,
            sinks is None, k_scale is None, v_scale is None,
        )  # fmt: skip
        slots = (q, key_cache, value_cache, out, sinks, k_scale, v_scale)
        if LAUNCHES.replay(key, slots):
            return out
        fixed = (cu_seqlens_q, seq_lens, block_table)
        if workspace is not None:
            fixed += (workspace.partial_out, workspace.partial_ml, workspace.counters)
        recording = LAUNCHES.record(key, slots, fixed)
    with recording:
        _run(
            q, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_table, max_query_len,
            float(scale), 0 if sliding_window is None else sliding_window, float(softcap),
            sinks, k_scale, v_scale, workspace, min_query_len=min_query_len,
        )  # fmt: skip
    return out

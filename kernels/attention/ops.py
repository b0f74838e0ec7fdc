"""The paged-attention entry points: the custom op (with its fake for torch.compile), the checked
call, and the unchecked call vLLM's layers after the first replay. Each comes in the bundled
form (`attention(q, key_cache, value_cache, out, batch, options, workspace)`) and the flat
keyword form users call (`paged_attention`, `args.flat_arguments`)."""

from __future__ import annotations

import contextlib

import torch

from .. import index_checks
from .._launch import LaunchCache, use_custom_op
from .args import AttentionOptions, PagedBatch, flat_arguments
from .balance import schedules_hold
from .checks import _check_args
from .plan import AttentionWorkspace
from .run import _run


@torch.library.custom_op(
    "fuselane::paged_attention",
    mutates_args=("out", "ws_partial_out", "ws_partial_ml", "ws_counters", "ws_schedule"),
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
    ws_schedule: torch.Tensor | None,
    ws_max_num_tokens: int,
    ws_max_splits: int,
    min_query_len: int = 0,
) -> None:
    """torch.library form of `attention`: the bundles flattened (`_op_arguments`), the window
    as an int (0 = off), the workspace as its four buffers."""
    workspace = None
    buffers = (ws_partial_out, ws_partial_ml, ws_counters, ws_schedule)
    if all(b is not None for b in buffers):
        workspace = AttentionWorkspace(
            partial_out=ws_partial_out,
            partial_ml=ws_partial_ml,
            counters=ws_counters,
            schedule=ws_schedule,
            max_num_tokens=ws_max_num_tokens,
            num_q_heads=q.shape[1],
            head_size=q.shape[2],
            max_splits=ws_max_splits,
        )
    batch = PagedBatch(cu_seqlens_q, seq_lens, block_table, max_query_len, min_query_len)
    options = AttentionOptions(scale, sliding_window or None, softcap, sinks, k_scale, v_scale)
    _run(q, key_cache, value_cache, out, batch, options, workspace)


@_paged_attention_op.register_fake
def _paged_attention_fake(*args, **kwargs) -> None:
    return None


def _op_arguments(
    batch: PagedBatch, options: AttentionOptions, workspace: AttentionWorkspace | None
) -> tuple:
    """The custom op's arguments after (q, key_cache, value_cache, out), in its order."""
    ws = workspace
    return (
        batch.cu_seqlens_q, batch.seq_lens, batch.block_table, batch.max_query_len,
        float(options.scale), options.window, float(options.softcap),
        options.sinks, options.k_scale, options.v_scale,
        None if ws is None else ws.partial_out, None if ws is None else ws.partial_ml,
        None if ws is None else ws.counters, None if ws is None else ws.schedule,
        0 if ws is None else ws.max_num_tokens,
        0 if ws is None else ws.max_splits, batch.min_query_len,
    )  # fmt: skip


def attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None = None,
) -> torch.Tensor:
    """Causal paged attention of a varlen batch (decode, prefill or mixed); writes and returns out.

    q:            [num_tokens, Hq, D] fp16/bf16
    key_cache:    [num_blocks, block_size, Hkv, D] q's dtype or float8_e4m3fn, last stride 1
    value_cache:  like key_cache
    out:          [num_tokens, Hq, D] q's dtype, written for rows < cu_seqlens_q[-1] only
    batch:        the step's layout (`PagedBatch`: cu_seqlens_q, seq_lens, block_table,
                  max_query_len, min_query_len, max_seq_len); flat form: those as arguments
    options:      the layer's options (`AttentionOptions`: scale, sliding_window, softcap,
                  sinks, k_scale, v_scale); flat form: those as keyword arguments
    workspace:    split-KV scratch; None runs without splits (slower for small decode batches)

    `max_query_len` picks the decode-only path when <= 8; `min_query_len` (0 = unknown), when
    every sequence with a query is longer than the decode kernel's positions (a step of prefill
    chunks only), skips the decode launch; `max_seq_len` is unused (see the package docstring).

    No host sync and no allocation: safe inside CUDA graphs.
    """
    _check_args(q, key_cache, value_cache, out, batch, options)
    _check_indices(q, key_cache, batch)
    if workspace is not None:
        if not isinstance(workspace, AttentionWorkspace):
            raise ValueError(
                f"workspace: expected an AttentionWorkspace, got {type(workspace).__name__}"
            )
        if workspace.partial_out.device != q.device:
            raise ValueError(
                f"workspace: expected device {q.device}, got {workspace.partial_out.device}"
            )
    if use_custom_op(q):
        _paged_attention_op(
            q, key_cache, value_cache, out, *_op_arguments(batch, options, workspace)
        )
    else:
        _run(q, key_cache, value_cache, out, batch, options, workspace)
    return out


# The unchecked entry point's recent launches: vLLM's layers after the first of a step replay
# the first one's (same metadata, shapes and options; their own q, caches and output).
LAUNCHES = LaunchCache()


def attention_unchecked(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None = None,
) -> torch.Tensor:
    """`attention` (same arguments) without its argument checks, for eager callers that passed
    the same kind of arguments (dtypes, head counts, cache tensors, options) through `attention`
    once: vLLM's backend, layer by layer, where host time per layer is step time on its eager
    path. Batch sizes may differ between calls; their consistency is the caller's contract.

    A call whose metadata tensors (the same objects), shapes, dtypes and options equal an
    earlier call's replays that call's launches with its own q, caches, output, sinks and
    scales (`LAUNCHES`, a `LaunchCache`): vLLM's layers after the first of each step."""
    if use_custom_op(q):  # traced: the checked custom-op path
        return attention(q, key_cache, value_cache, out, batch, options, workspace)
    _check_indices(q, key_cache, batch)
    recording: contextlib.AbstractContextManager = contextlib.nullcontext()
    # A captured graph is replayed with other batches: its plan keeps the decode launch
    # (`_skips_decode`), which a recording made outside the capture may have left out.
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        b, o = batch, options
        # Everything a launch depends on besides the layer's own tensors (see LaunchCache).
        # The batch itself and its lengths' versions too: a balanced split's schedule, which
        # the recording keeps (`balance.balanced_schedule`), holds for this batch's lengths. A
        # new step is a new PagedBatch even where its tensors are the same objects written
        # without a version bump (by a kernel or a graph), and lengths updated in place record
        # anew. (Callers of the flat form build a PagedBatch per call: they record every call.)
        key = (
            id(b), b.lengths_version(),
            id(b.cu_seqlens_q), id(b.seq_lens), id(b.block_table), id(workspace), q.shape,
            q.stride(), q.dtype, out.shape, out.stride(), out.dtype, key_cache.shape,
            key_cache.stride(), value_cache.shape, value_cache.stride(), key_cache.dtype,
            value_cache.dtype, b.max_query_len, b.min_query_len, o.scale, o.sliding_window,
            o.softcap, o.sinks is None, o.k_scale is None, o.v_scale is None,
        )  # fmt: skip
        slots = (q, key_cache, value_cache, out, o.sinks, o.k_scale, o.v_scale)
        # A recording reads its batch's schedule in a workspace slot that another batch's may
        # have taken since (`balance.schedules_hold`): then the call runs and records anew.
        if schedules_hold(b, workspace) and LAUNCHES.replay(key, slots):
            return out
        fixed = (b, b.cu_seqlens_q, b.seq_lens, b.block_table)
        if workspace is not None:
            fixed += (workspace.partial_out, workspace.partial_ml, workspace.counters)
        recording = LAUNCHES.record(key, slots, fixed)
    with recording:
        _run(q, key_cache, value_cache, out, batch, options, workspace)
    return out


def _check_indices(q: torch.Tensor, key_cache: torch.Tensor, batch: PagedBatch) -> None:
    if index_checks.enabled():  # FUSELANE_CHECK_INDICES: the device-side indices, synced
        index_checks.check_paged_batch(
            q, key_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table
        )


paged_attention = flat_arguments(attention, "paged_attention")
paged_attention_unchecked = flat_arguments(attention_unchecked, "paged_attention_unchecked")

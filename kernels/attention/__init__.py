"""Paged attention over vLLM's KV cache: decode, prefill and mixed batches behind one entry point.

Semantics are those of vLLM's TRITON_ATTN backend (varlen layout, as `unified_attention`
receives it):

- `q [num_tokens, Hq, D]` fp16/bf16; the query tokens of sequence b are rows
  `cu_seqlens_q[b] : cu_seqlens_q[b + 1]` and are the last `query_len` positions of a sequence
  of `seq_lens[b]` keys (KV length including the new tokens). Rows of `q`/`out` past
  `cu_seqlens_q[-1]` (CUDA-graph padding) are neither read nor written.
- `key_cache` / `value_cache [num_blocks, block_size, Hkv, D]` with any strides whose last one
  is 1 (views of one KV tensor), fp16/bf16 like q, or fp8 e4m3 with per-tensor fp32 scales
  (`k_scale`, `v_scale`: one-element tensors; value = stored * scale).
- causal; GQA/MQA (Hq a multiple of Hkv); sliding window with vLLM's convention (the model's
  `sliding_window` W: a query at absolute position p sees keys k with p - W < k <= p, i.e.
  TRITON_ATTN's `SLIDING_WINDOW = 1 + window_size[0]` with `window_size = (W - 1, 0)`); logit
  soft cap (`softcap * tanh(s / softcap)` on the scaled logit s); attention sinks (one fp32
  logit per query head, in the units of the scaled logits, that joins the softmax denominator
  only).

How a call runs (`plan_launch` decides, from shapes only, so a CUDA graph captured for one batch
shape stays valid for any sequence lengths replayed into it):

- `max_query_len <= qpos_cap` (decode, speculative verify): `_decode_kernel`, flash-decoding
  with the work of each (sequence, kv head) split over `num_splits` programs when the batch
  alone cannot fill the GPU's program slots; the last split program of each (sequence, kv head)
  merges the partials (one launch).
- otherwise (prefill, mixed): the decode kernel takes the sequences with query_len <= qpos_cap
  and `_prefill_kernel` the others; both are launched over the whole batch and each program
  reads its sequence's query_len on the device to know whether it is its own. A caller that
  knows on the host that no sequence is short enough for the decode kernel (`min_query_len`:
  a step of prefill chunks only) has the prefill kernel launched alone, outside CUDA-graph
  capture.

On Hopper (sm_90), where the call's dtypes, alignment and options allow it
(`hopper.warp_specialized_ok`), two of those launches are Gluon kernels with warp-specialized
loader and compute warpgroups instead: prefill launches (`prefill_ws`; at head size <= 128 its
128-row tile where the 256-row one would fill at most one wave, otherwise from
`PREFILL_WS_MIN_FILL` x SMs programs of its tile on, `PREFILL_WS_MIN_FILL_FP8` for an fp8
cache) and a decode-only batch of one sequence with at least `DECODE_WS_MIN_SPLITS` splits
(`decode_ws`). The choice depends on shapes and static properties only, like the rest of the
plan.

`max_query_len` and `max_seq_len` only pick the path: every path is exact for any query
lengths (the decode kernel walks longer queries in chunks), and `max_seq_len` is not used at
all, since CUDA-graph replays change sequence lengths under a captured launch.

Modules: `args` (the argument bundles `PagedBatch` and `AttentionOptions`, and the flat public
signature), `plan` (launch rules), `workspace` (the split-KV scratch), `decode`, `prefill`
(Triton kernels), `balance` (the decode kernel's balanced split: each program's piece),
`decode_ws`, `prefill_ws` (Hopper's Gluon kernels), `hopper` (whether those
may run), `checks`, `run` (launching a plan, the start-up warm-up), `ops` (the entry points),
`reference`.
"""

from __future__ import annotations

from . import args, balance, checks, hopper, ops, plan, reference, run, workspace
from .args import AttentionOptions, PagedBatch
from .balance import balanced_pieces
from .checks import (
    check_supported,
)
from .hopper import (
    DECODE_WS_HEAD_SIZES,
    WS_HEAD_SIZES,
    decode_warp_specialized_ok,
    disable_hopper_kernels,
    enable_hopper_kernels,
    hopper_kernels_off,
    warp_specialized_ok,
)
from .ops import (
    LAUNCHES,
    attention,
    attention_unchecked,
    paged_attention,
    paged_attention_unchecked,
)
from .plan import (
    CPU_SM_COUNT,
    DECODE_MAX_QUERY_LEN,
    DECODE_MAX_ROWS,
    DECODE_MAX_TILE_N,
    DECODE_REGS_PER_THREAD,
    DECODE_STAGES,
    DECODE_STAGES_PIPELINED,
    DECODE_TILE_BYTES,
    DECODE_WARPS,
    DECODE_WS_MAX_SPLITS,
    DECODE_WS_MIN_SPLITS,
    DECODE_WS_ROWS,
    DECODE_WS_RULE,
    DECODE_WS_TILE,
    MAX_GQA_GROUP,
    MAX_GRID_YZ,
    NO_SPLIT_CTAS_PER_SM,
    PREFILL_HEAD_FAST,
    PREFILL_MIN_PROGRAMS,
    PREFILL_SMALL_TILE,
    PREFILL_STAGE_FALLBACKS,
    PREFILL_TILES,
    PREFILL_WS_MIN_FILL,
    PREFILL_WS_MIN_FILL_FP8,
    PREFILL_WS_SMALL_ROWS,
    PREFILL_WS_TILE,
    PREFILL_WS_TILE_D256,
    PROGRAM_OVERHEAD,
    REGS_PER_SM,
    SMEM_PER_BLOCK_MAX,
    SMEM_PER_BLOCK_RESERVED,
    SMEM_PER_SM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_Q_DTYPES,
    WAVE_FILL_MARGIN,
    WS_PREFILL_RULE_HEAD_SIZES_16BIT,
    WS_RULE_HEAD_SIZES,
    DecodeConfig,
    LaunchPlan,
    PrefillConfig,
    decode_programs_per_sm,
    decode_schedules,
    decode_smem_bytes,
    decode_ws_config,
    decode_ws_smem_bytes,
    decode_ws_tile,
    kv_buffers,
    plan_launch,
    prefill_smem_bytes,
    prefill_ws_config,
    prefill_ws_rule_applies,
    prefill_ws_tile,
    reachable_plans,
    sm_count,
    smem_per_block,
    split_cost,
    supported_head_sizes,
    wave_fill,
)
from .reference import (
    attention_reference,
    paged_attention_reference,
)
from .run import (
    warm_up,
)
from .workspace import (
    DEFAULT_MAX_SPLITS,
    SUPPORTED_HEAD_SIZES,
    AttentionWorkspace,
    SplitRoom,
    split_room,
    workspace_budget,
    workspace_splits,
)

__all__ = [
    "CPU_SM_COUNT",
    "DECODE_MAX_QUERY_LEN",
    "DECODE_MAX_ROWS",
    "DECODE_MAX_TILE_N",
    "DECODE_REGS_PER_THREAD",
    "DECODE_STAGES",
    "DECODE_STAGES_PIPELINED",
    "DECODE_TILE_BYTES",
    "DECODE_WARPS",
    "DECODE_WS_HEAD_SIZES",
    "DECODE_WS_MAX_SPLITS",
    "DECODE_WS_MIN_SPLITS",
    "DECODE_WS_ROWS",
    "DECODE_WS_RULE",
    "DECODE_WS_TILE",
    "DEFAULT_MAX_SPLITS",
    "LAUNCHES",
    "MAX_GQA_GROUP",
    "MAX_GRID_YZ",
    "NO_SPLIT_CTAS_PER_SM",
    "PREFILL_HEAD_FAST",
    "PREFILL_MIN_PROGRAMS",
    "PREFILL_SMALL_TILE",
    "PREFILL_STAGE_FALLBACKS",
    "PREFILL_TILES",
    "PREFILL_WS_MIN_FILL",
    "PREFILL_WS_MIN_FILL_FP8",
    "PREFILL_WS_SMALL_ROWS",
    "PREFILL_WS_TILE",
    "PREFILL_WS_TILE_D256",
    "PROGRAM_OVERHEAD",
    "REGS_PER_SM",
    "SMEM_PER_BLOCK_MAX",
    "SMEM_PER_BLOCK_RESERVED",
    "SMEM_PER_SM",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_KV_CACHE_DTYPES",
    "SUPPORTED_Q_DTYPES",
    "WAVE_FILL_MARGIN",
    "WS_HEAD_SIZES",
    "WS_PREFILL_RULE_HEAD_SIZES_16BIT",
    "WS_RULE_HEAD_SIZES",
    "AttentionOptions",
    "AttentionWorkspace",
    "DecodeConfig",
    "LaunchPlan",
    "PagedBatch",
    "PrefillConfig",
    "SplitRoom",
    "args",
    "attention",
    "attention_reference",
    "attention_unchecked",
    "balance",
    "balanced_pieces",
    "check_supported",
    "checks",
    "decode_programs_per_sm",
    "decode_schedules",
    "decode_smem_bytes",
    "decode_warp_specialized_ok",
    "decode_ws_config",
    "decode_ws_smem_bytes",
    "decode_ws_tile",
    "disable_hopper_kernels",
    "enable_hopper_kernels",
    "hopper",
    "hopper_kernels_off",
    "kv_buffers",
    "ops",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_unchecked",
    "plan",
    "plan_launch",
    "prefill_smem_bytes",
    "prefill_ws_config",
    "prefill_ws_rule_applies",
    "prefill_ws_tile",
    "reachable_plans",
    "reference",
    "run",
    "sm_count",
    "smem_per_block",
    "split_cost",
    "split_room",
    "supported_head_sizes",
    "warm_up",
    "warp_specialized_ok",
    "wave_fill",
    "workspace",
    "workspace_budget",
    "workspace_splits",
]

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
(`warp_specialized_ok`), two of those launches are Gluon kernels with warp-specialized loader
and compute warpgroups instead: the prefill launches of the 256-row tile
(`attention_prefill_ws`) and decode-only batches small enough for one program per SM with at
least `DECODE_WS_MIN_SPLITS` splits (`attention_decode_ws`). The choice depends on shapes and
static properties only, like the rest of the plan.

`max_query_len` and `max_seq_len` only pick the path: every path is exact for any query
lengths (the decode kernel walks longer queries in chunks), and `max_seq_len` is not used at
all, since CUDA-graph replays change sequence lengths under a captured launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ._checks import FP8_E4M3, check_choice, check_kernel_device, check_tensor
from ._launch import LaunchCache, cdiv, next_pow2, use_custom_op
from ._triton_compat import gluon_hopper_missing
from .attention_decode import launch_decode
from .attention_prefill import launch_prefill

# Hopper's warp-specialized kernels are written in Gluon (Triton's experimental API; 3.6 to
# 3.9 have what they use). Without it the Triton kernels run every batch.
if gluon_hopper_missing() is None:
    from . import attention_decode_ws as decode_ws
    from . import attention_prefill_ws as prefill_ws
else:
    decode_ws = prefill_ws = None  # type: ignore[assignment]
_WS_HEAD_SIZES = prefill_ws.WS_HEAD_SIZES if prefill_ws is not None else ()
# Why the Hopper kernels are off in this process (None: the launch rule may pick them).
_hopper_off: str | None = gluon_hopper_missing()


def hopper_kernels_off() -> str | None:
    """Why Hopper's warp-specialized kernels are off in this process (None: they may run)."""
    return _hopper_off


def disable_hopper_kernels(reason: str) -> None:
    """Keep Hopper's warp-specialized kernels out of every later plan in this process (the
    Triton kernels take their batches); `reason` is what `hopper_kernels_off` reports. Plans
    already recorded for replay keep them until their step's metadata changes."""
    global _hopper_off
    _hopper_off = reason
    LAUNCHES.clear()


def enable_hopper_kernels() -> None:
    """Undo `disable_hopper_kernels` (tests); a Triton without Gluon keeps them off."""
    global _hopper_off
    _hopper_off = gluon_hopper_missing()


SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)


def warp_specialized_ok(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    sliding_window: int,
    softcap: float,
    has_sinks: bool,
) -> bool:
    """Whether Hopper's warp-specialized kernels can run a call with these tensors and options
    (`attention_prefill_ws.supports`; False while `hopper_kernels_off`)."""
    return _hopper_off is None and prefill_ws.supports(
        q, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap,
        has_sinks=has_sinks,
    )  # fmt: skip


SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64)
# fp32 is for exactness checks and the CPU engine (vLLM's fp32 runs give token-identical greedy
# output to transformers); on a GPU it takes the slow ieee fp32 dot path, not tensor cores.
SUPPORTED_Q_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    FP8_E4M3,
)
# Query heads per kv head: the decode tile packs a whole group into at most 128 rows.
MAX_GQA_GROUP = 128
# Longest query the decode kernel takes in a mixed batch (vLLM's MAX_3D_QUERY_LEN: decode rows
# and speculative-verify rows of 1 + num_speculative_tokens).
DECODE_MAX_QUERY_LEN = 8
# Rows of a decode tile (query positions x group heads) are capped so its fp32 accumulator
# stays in registers.
DECODE_MAX_ROWS = 128
DEFAULT_MAX_SPLITS = 64
# Split-KV rule (shapes only; see _num_splits). A batch of at least NO_SPLIT_CTAS_PER_SM * SMs
# (sequence, kv head) programs never splits (plugin/backend.py sizes its workspace from this).
# Below that, the split count minimizes waves(s) * (1 / s + PROGRAM_OVERHEAD): waves of equal
# programs over the SMs' program slots, each program 1 / s of a (sequence, kv head)'s KV plus a
# fixed start-up cost. PROGRAM_OVERHEAD: a few us per program (launch, q and block-table loads,
# the first tile's latency, write-out; run 2's B=1 points imply 3-6 us) over ~260 us (one kv
# head of an 8k context at two programs per SM sharing the ~33 GB/s per SM of the tile-128
# kernel at B=64; H200, run 2, 2026-11-21).
NO_SPLIT_CTAS_PER_SM = 2
PROGRAM_OVERHEAD = 0.02
# SM count assumed off-GPU (Triton interpreter): an H100 SXM / H200.
CPU_SM_COUNT = 132
# Largest grid extent on CUDA's second and third axes.
MAX_GRID_YZ = 65535


def supported_head_sizes() -> tuple[int, ...]:
    """Head sizes the kernels compile for (non-powers of two run in padded tiles)."""
    return SUPPORTED_HEAD_SIZES


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


@dataclass(frozen=True)
class AttentionWorkspace:
    """Split-KV scratch, allocated once per engine and reused by every layer and step.

    partial_out: [max_num_tokens * num_q_heads * max_splits * head_pad] fp32
    partial_ml:  [max_num_tokens * num_q_heads * max_splits * 2] fp32 (running max, sum)
    counters:    [max_num_tokens * num_q_heads] int32, zero between launches: the fused merge
                 counts the finished splits of each (sequence, kv head) and resets its count

    A call uses `num_seqs * qpos * Hq * num_splits` partial rows (qpos: the decode tile's query
    positions, 1 for plain decode); when that does not fit, the call runs with fewer splits. The
    fit depends on shapes only, so CUDA graphs stay valid.
    """

    partial_out: torch.Tensor
    partial_ml: torch.Tensor
    counters: torch.Tensor
    max_num_tokens: int
    num_q_heads: int
    head_size: int
    max_splits: int

    @classmethod
    def allocate(
        cls,
        max_num_tokens: int,
        num_q_heads: int,
        head_size: int,
        device: torch.device,
        max_splits: int = DEFAULT_MAX_SPLITS,
    ) -> AttentionWorkspace:
        """Allocate room for `max_num_tokens` split query rows of `num_q_heads` heads.

        max_num_tokens: the most (sequences x query rows) a split launch should cover, e.g.
        the largest decode batch that still leaves the GPU idle (4 * SMs / Hkv sequences) times
        1 + num_speculative_tokens. Memory: max_num_tokens * num_q_heads * max_splits *
        (next_pow2(head_size) + 2) * 4 bytes, plus max_num_tokens * num_q_heads * 4 bytes of
        counters.
        """
        for name, value in (
            ("max_num_tokens", max_num_tokens),
            ("num_q_heads", num_q_heads),
            ("max_splits", max_splits),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        check_choice("head_size", head_size, SUPPORTED_HEAD_SIZES)
        rows = max_num_tokens * num_q_heads * max_splits
        head_pad = next_pow2(head_size)
        return cls(
            partial_out=torch.empty(rows * head_pad, dtype=torch.float32, device=device),
            partial_ml=torch.empty(rows * 2, dtype=torch.float32, device=device),
            counters=torch.zeros(max_num_tokens * num_q_heads, dtype=torch.int32, device=device),
            max_num_tokens=max_num_tokens,
            num_q_heads=num_q_heads,
            head_size=head_size,
            max_splits=max_splits,
        )


@dataclass(frozen=True)
class DecodeConfig:
    qpos: int  # query positions per decode tile
    block_m: int  # rows of the tile: next_pow2(max(16, qpos * group))
    tile_n: int  # KV tokens per loop step
    num_splits: int
    max_q: int  # sequences with a longer query are the prefill kernel's (0: none)
    num_warps: int
    num_stages: int
    fused_reduce: bool = True  # splits merged by the last split program (False: a 2nd launch)
    head_fast: bool = False  # grid order: kv head fastest (programs of one sequence together)
    # Hopper's warp-specialized kernel (attention_decode_ws), decode-only batches: num_stages
    # is its ring of K/V slots; block_m, num_warps and max_q are the Triton kernel's only.
    warp_specialized: bool = False


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows of the Q tile (block_m // group query positions)
    block_n: int  # KV tokens per loop step
    min_q: int  # sequences with query_len <= min_q are the decode kernel's
    num_warps: int
    num_stages: int
    head_fast: bool = False  # grid order: kv head fastest (every head's heaviest blocks first)
    # Hopper's warp-specialized kernel (attention_prefill_ws): num_stages is its ring of K/V
    # slots, num_warps its compute warps' count per warpgroup launch (loader warps added).
    warp_specialized: bool = False


@dataclass(frozen=True)
class LaunchPlan:
    decode: DecodeConfig
    prefill: PrefillConfig | None


@functools.cache
def _cuda_limits(index: int) -> tuple[int, int]:
    """(streaming multiprocessors, shared memory one block may use in bytes) of CUDA device
    `index`."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", SMEM_PER_BLOCK_MAX)
    return props.multi_processor_count, int(smem)


def _device_limits(device: torch.device) -> tuple[int, int]:
    """`_cuda_limits` of `device` (read once per device); an H100 / H200's off-GPU."""
    if device.type != "cuda":
        return CPU_SM_COUNT, SMEM_PER_BLOCK_MAX
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_limits(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; CPU_SM_COUNT off-GPU."""
    return _device_limits(device)[0]


def smem_per_block(device: torch.device) -> int:
    """Shared memory one block may use on `device` (bytes); Hopper's opt-in limit off-GPU."""
    return _device_limits(device)[1]


# Decode tile, measured on an H200 (run 2, 2026-11-21; bf16, Hq=32, Hkv=8, D=128, page 16;
# docs/tuning/attention.md), us per call for 64 KV tokens per step (4 warps, 3 stages) vs 128:
# B=1 ctx 32k (64 splits) 51.5 vs 47.7-48.0; B=16 ctx 4k (5 splits) 81.8 vs 83.0-83.3;
# B=64 ctx 4k (unsplit) 325.5 vs 251.3-251.6 (= FlashInfer). 2 vs 3 stages at 128 tokens: within
# 0.5%. 8 warps: 255 (B=64) to 110 (B=16), always slower.
# Stages: K/V rows are gathered through the block table, a load feeding a load. Triton 3.6's
# pipeliner then gives each level (num_stages - 1) // 2 iterations of latency and allocates
# that many K/V buffers; with one buffer the next tile's copy is issued after the current one is
# consumed and waited on at the top of the next iteration (async_wait num=0): no overlap of load
# and compute. Compiled for sm_90a here (triton.compile + ptxas -v, D=128, tile 128, 4 warps):
# 2-4 stages: 1 buffer, 74 KiB shared memory, 230-255 registers (2 programs per SM, register-
# bound); 5 stages: 2 buffers (one tile in flight during compute), 137 KiB (1 per SM); 7: 3
# buffers, 201 KiB. Run 2's "2 vs 3 stages" were thus the same schedule.
# Two schedules: 3 stages, two programs per SM hiding each other's loads (kv-head-fastest
# grid), or 5 stages, one program per SM with a K/V tile always in flight (seq-major grid).
# Each gets its own split count; measured on an H200 (runs 5 and 6, 2026-11-22, ctx 4096 unless
# given; us, 3-stage vs 5-stage plan): B=1 ctx 32k 44.7 (33 splits) vs 44.4 (16); B=4 25.8 vs
# 26.3; B=16 82.8 vs 67.2; B=24 113.0 vs 124.7; B=32 125.3 vs 131.9; B=48 206.2 vs 196.7;
# B=64 243.2 vs 255.1; B=128 ctx 8k 939.8 vs 966.8; B=256 ctx 2k 481.1 vs 517.6. The 5-stage
# plan wins exactly where the 3-stage plan's last wave of programs is far from full (B=16: 128
# programs on 264 slots, B=48: 384) and its own is not, so the rule compares the wave fill of
# the unsplit batch (see wave_fill) and takes 5 stages only when they need no split and fill
# clearly better (WAVE_FILL_MARGIN). Split batches keep 3 stages: run 7 (same shapes) B=4 25.7
# (3 stages, 8 splits) vs 26.9 (5, 4); B=8 42.7 (4 splits) vs 43.1 (2); B=1 45.1 vs 44.2 is
# the one loss (2%). Run 7 confirmed the rule at B=24 / 32 / 40 / 48: 112.8 / 124.6 / 184.9 /
# 197.3 vs 125.1 / 132.2 / 199.3 / 205.0 for the other schedule.
DECODE_TILE_BYTES = 128 * 128 * 2  # one stage of K (or V): 128 tokens x 128 dims x bf16
DECODE_MAX_TILE_N = 128  # the largest measured; D=64 stays at 128 tokens (32 KiB per stage)
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_STAGES_PIPELINED = 5
WAVE_FILL_MARGIN = 0.1


def wave_fill(programs: int, slots: int) -> float:
    """Busy fraction of the program slots over the waves a launch of `programs` needs."""
    return programs / (slots * math.ceil(programs / slots))


def _decode_tile(
    qpos: int, group: int, head_size: int, num_stages: int = DECODE_STAGES
) -> tuple[int, int, int, int]:
    """(block_m, tile_n, num_warps, num_stages) of the decode kernel.

    128 KV tokens per step at D <= 128 (64 KiB of bf16 K+V per pipeline stage at D = 128), 64 at
    D = 256 (the same bytes per stage). Tiles of more than 64 rows (QPOS x group) get 8 warps
    (not measured).
    """
    block_m = max(16, next_pow2(qpos * group))
    head_pad = next_pow2(head_size)
    tile_n = min(DECODE_MAX_TILE_N, DECODE_TILE_BYTES // (head_pad * 2))
    num_warps = DECODE_WARPS if block_m <= 64 else 8
    return block_m, tile_n, num_warps, num_stages


def kv_buffers(num_stages: int) -> int:
    """K/V tiles Triton 3.6 keeps in shared memory for a load gathered through one level of
    indirection: (num_stages - 1) // 2, at least 1 (observed on sm_90a: 2-4 stages 1, 5-6 2,
    7 3)."""
    return max(1, (num_stages - 1) // 2)


# Per SM on Hopper: 228 KiB of shared memory (1 KiB of it reserved per block), 64 Ki registers.
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK_RESERVED = 1024
SMEM_PER_BLOCK_MAX = 227 * 1024  # the opt-in limit of one block
REGS_PER_SM = 65536
# Registers per thread of the decode kernel (ptxas -v, sm_90a, Triton 3.6: 208-255 at 4 warps
# for tile 128 D=128, split or not): taken as 255, i.e. at most 2 programs per SM at 4 warps.
DECODE_REGS_PER_THREAD = 255


def decode_smem_bytes(block_m: int, tile_n: int, head_size: int, num_stages: int,
                      kv_bytes: int) -> int:  # fmt: skip
    """Shared memory of the decode kernel: kv_buffers x (K + V tile + block-table entries) +
    the q tile + the P tile (matches the compiled size for tile 64/128 and 3/5/7 stages)."""
    head_pad = next_pow2(head_size)
    per_buffer = tile_n * head_pad * 2 * kv_bytes + tile_n * 4
    return kv_buffers(num_stages) * per_buffer + block_m * head_pad * 2 + block_m * tile_n * 2


def decode_programs_per_sm(
    block_m: int, tile_n: int, head_size: int, num_warps: int, num_stages: int, kv_bytes: int
) -> int:
    """Decode programs an SM holds at once: the smaller of the shared-memory and the register
    bound (1 for 8 warps; for the bf16 default at D=128, 2: 74 KiB and ~255 registers each)."""
    smem = decode_smem_bytes(block_m, tile_n, head_size, num_stages, kv_bytes)
    by_smem = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    by_regs = REGS_PER_SM // (DECODE_REGS_PER_THREAD * 32 * num_warps)
    return max(1, min(by_smem, by_regs))


# Prefill tile at D <= 128, measured on an H200 (run 2, 2026-11-21; bf16, Hq=32, Hkv=8, D=128,
# causal, S=8192; TFLOP/s): 128x64 4 warps 3 stages 394; 128x128 8 warps 2 stages 366; 128x64
# 8 warps 3 stages (the previous default) 322, 4 stages 321 (the same K/V lookahead, see the
# decode stages note); 64x64 4 warps 335; 64x128 273; 128x32 232. D=256: not measured (64 rows
# keep Q and two K/V tiles in shared memory). Grid order, run 5 (same shapes, TFLOP/s): the
# kv-head-fastest grid (every head's heaviest q blocks first) beat the seq-major one at every
# length, 370.7 vs 325.9 (S=4k), 405.1 vs 399.1 (8k), 421.7 vs 410.6 (16k): PREFILL_HEAD_FAST.
# Run 6 (2026-11-22, same shapes): 256x64 tiles, 8 warps (two warpgroups sharing each K/V
# tile), 5 stages (one K/V tile in flight), kv-head-fastest: 403.6 / 436.6 / 455.7 at 4k / 8k /
# 16k vs 374.8 / 409.3 / 422.7 for 128x64 4 warps 3 stages; 3 stages 400.1 / 428.9 / 441.8;
# seq-major 339.5 / 440.7 / 457.8; 128x128 8 warps 5 stages 357.6 / 401.8 / 406.8. D=64 keeps
# the run-2 tile (not re-measured).
PREFILL_TILES = {  # head_pad bound -> (block_m, block_n, num_warps, num_stages)
    64: (128, 64, 4, 3),
    128: (256, 64, 16, 7),
    256: (64, 64, 8, 2),
}
# D <= 128, since 2026-11-26: the same 256x64 tile with 16 warps, four warpgroups of 64 rows
# sharing each K/V tile (128 registers a thread, 56 B of spills at sm_90a, against 255
# registers and 128 B at 8 warps; half the instructions), and 7 stages (two K/V tiles in
# flight, 193 KiB of shared memory). H200 (attention-h200-2026-11-26-prefill-sweep*.json,
# TFLOP/s at S = 4k / 8k / 16k): 16 warps 7 stages 416.9 / 448.3 / 463.2; 16 warps 5 stages
# 414.2 / 443.8 / 439.2 and 418.3 / 442.9 / 447.4; 8 warps 5 stages (the previous rule)
# 398.7 / 430.5 / 447.2 and 395.1 / 426.4 / 448.1; 16 warps 3 stages 379.5 / 406.8 / 416.8;
# 256x32 16 warps 5 / 7 stages 380.4 / 404.2 / 411.3 and 372.3 / 402.0 / 399.7; 128x64 8 warps
# 5 stages 355.0 / 387.5 / 395.7.
# A device whose block shared memory cannot hold a tile takes fewer stages, then the small tile
# (A100: 163 KiB per block; sm_89: 99 KiB).
PREFILL_STAGE_FALLBACKS = (5, 3)
# Hopper, where the call's dtypes and options allow it (attention_prefill_ws.supports): the
# warp-specialized kernel for the launches that take the large tile: 256 rows in two compute
# warpgroups, 64 keys, a ring of 4 K/V slots (193 KiB of shared memory), kv-head-fastest grid.
# H200, same run as the Triton rule (attention-h200-2026-11-26-ws-sweep.json, TFLOP/s at
# S = 4k / 8k / 16k): 465.9 / 508.7 / 529.3 against 425.8 / 456.4 / 473.4; 3 slots 464.4 /
# 503.8 / 508.2, 2 slots 442.7 / 498.5 / 498.6; seq-major grid 410.9 / 513.3 / 533.7; 128 rows
# (one warpgroup's 64 each) 386.5 / 415.5 / 424.2; 128x128 with 2 slots 270.4 / 286.7 / 294.8.
# Final run (-ws-final.json): 460.3 / 500.0 / 517.6; 5 slots 450.5 / 499.5 / 499.6.
PREFILL_WS_TILE = (256, 64, 4, 4)  # (block_m, block_n, warps per compute warpgroup, slots)
# Head sizes the rule gives either Hopper kernel: measured at 128 only (64 passes the GPU
# tests, not timed).
WS_RULE_HEAD_SIZES = (128,)
# Hopper, decode-only batches too small to fill the GPU (B=1 ... 4 at Hkv=8 on 132 SMs): the
# warp-specialized decode kernel, one program per SM (144 KiB of shared memory: a 64-row Q
# tile, two slots of 128-token K/V tiles), splits = SMs // (sequences x kv heads).
# H200, B=1 ctx 32768 (attention-h200-2026-11-26-ws-decode.json): 128-token tiles, 2 slots, 16
# splits 40.07 us (3.35 TB/s) against FlashInfer's 42.17 and the Triton kernel's 45.5; 64-token
# tiles 4 / 6 slots 40.78 / 41.14; 33 splits (two programs per SM) 49.0-49.8; 8 splits 58.8-60.3.
# B=16 (not taken): 68.0 against the Triton kernel's 67.7. Final run (-ws-final.json): B=1
# 40.0 us; ctx 4096: B=2 14.3 (Triton kernel 15.1), B=4 23.7 (26.9).
DECODE_WS_TILE = (128, 2)  # (tile_n, slots)
DECODE_WS_ROWS = 64  # the compute tile: one wgmma warpgroup's rows, >= query heads per kv head
DECODE_WS_MIN_SPLITS = 4
DECODE_WS_MAX_SPLITS = 64
PREFILL_HEAD_FAST = True
# Short prefills: 256-row tiles leave SMs idle (a 512-token prompt of Hkv=8, GQA 4 is 8 q blocks
# x 8 heads = 64 programs on 132 SMs; vLLM 0.26 e2e on the H200, 2026-11-22: p50 TTFT 1.3-1.5x
# FLASH_ATTN's at 512-token prompts). Below PREFILL_MIN_PROGRAMS x SMs programs of the large
# tile the 128-row tile of run 2 is used (twice the programs).
PREFILL_SMALL_TILE = (128, 64, 4, 3)
PREFILL_MIN_PROGRAMS = 2


def _prefill_tile(
    group: int,
    head_size: int,
    programs: int | None = None,
    sms: int = CPU_SM_COUNT,
    max_smem: int = SMEM_PER_BLOCK_MAX,
    kv_bytes: int = 2,
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the prefill kernel (PREFILL_TILES).
    `programs`: the large tile's program count for the launch, when known; below
    PREFILL_MIN_PROGRAMS x `sms` the small tile is used. `max_smem`: the device's shared memory
    per block (bytes): a tile that does not fit takes fewer stages (PREFILL_STAGE_FALLBACKS),
    then the small tile."""
    head_pad = next_pow2(head_size)
    bound = min(b for b in PREFILL_TILES if b >= head_pad)
    tiles = [PREFILL_TILES[bound]]
    small = PREFILL_SMALL_TILE
    if small[0] < tiles[0][0] and small[0] >= next_pow2(group):
        few_programs = programs is not None and programs < PREFILL_MIN_PROGRAMS * sms
        tiles = [small] if few_programs else [tiles[0], small]
    for block_m, block_n, num_warps, num_stages in tiles:
        block_m = max(block_m, next_pow2(group))
        for stages in (num_stages, *(s for s in PREFILL_STAGE_FALLBACKS if s < num_stages)):
            if prefill_smem_bytes(block_m, block_n, head_size, stages, kv_bytes) <= max_smem:
                return block_m, block_n, num_warps, stages
    return block_m, block_n, num_warps, min(PREFILL_STAGE_FALLBACKS)


def prefill_smem_bytes(
    block_m: int, block_n: int, head_size: int, num_stages: int, kv_bytes: int
) -> int:
    """Shared memory of the prefill kernel: the decode kernel's layout (q tile, P tile and
    kv_buffers(num_stages) K/V tiles with their block-table entries; 164352 bytes for 256x64
    at D=128, 5 stages, as compiled for sm_90a)."""
    return decode_smem_bytes(block_m, block_n, head_size, num_stages, kv_bytes)


def split_cost(pairs: int, splits: int, slots: int) -> float:
    """Modelled decode time of `pairs` (sequence, kv head) streams cut into `splits` programs
    each, on `slots` program slots, in units of one whole stream: full waves of programs, each
    1 / splits of a stream plus PROGRAM_OVERHEAD."""
    waves = math.ceil(pairs * splits / slots)
    return waves * (1.0 / splits + PROGRAM_OVERHEAD)


@dataclass(frozen=True)
class SplitRoom:
    """What the split rule needs of a workspace: its buffer sizes (elements) and split cap."""

    partial_out: int
    partial_ml: int
    counters: int
    max_splits: int


def split_room(workspace: AttentionWorkspace | None) -> SplitRoom | None:
    if workspace is None:
        return None
    return SplitRoom(
        workspace.partial_out.numel(),
        workspace.partial_ml.numel(),
        workspace.counters.numel(),
        workspace.max_splits,
    )


def workspace_splits(workspace: SplitRoom, row_heads: int, head_pad: int, pairs: int) -> int:
    """Most splits `workspace` holds the partials of (`row_heads` query rows x heads, each
    `head_pad` wide) and the counters of (`pairs` (sequence, kv head) pairs) for; 1 if none."""
    if workspace.counters < pairs:
        return 1
    return min(
        workspace.partial_out // (row_heads * head_pad),
        workspace.partial_ml // (row_heads * 2),
        workspace.max_splits,
    )


def _num_splits(
    num_seqs: int,
    num_kv_heads: int,
    rows: int,
    num_q_heads: int,
    head_size: int,
    slots: int,
    sms: int,
    workspace: SplitRoom | None,
) -> int:
    """Split count from the batch shape, the program slots and the workspace (never lengths).

    Examples at Hkv=8 on 132 SMs, two decode programs per SM (bf16, D=128, 264 slots): B=1 ->
    33 splits (one wave of 1024-token pieces at ctx 32k), B=2 -> 16, B=8 -> 4, B=16 -> 2 (256
    programs), B=20 -> 3 (160 programs would fill one wave to 61%), B >= 32 -> 1.
    """
    if workspace is None:
        return 1
    pairs = num_seqs * num_kv_heads
    if pairs >= NO_SPLIT_CTAS_PER_SM * sms:
        return 1
    fit = workspace_splits(workspace, rows * num_q_heads, next_pow2(head_size), pairs)
    best, best_cost = 1, split_cost(pairs, 1, slots)
    for splits in range(2, min(fit, MAX_GRID_YZ) + 1):
        cost = split_cost(pairs, splits, slots)
        if cost < best_cost - 1e-9:  # ties go to fewer splits
            best, best_cost = splits, cost
    return best


def plan_launch(
    *,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_query_len: int,
    sms: int,
    workspace: AttentionWorkspace | None,
    kv_bytes: int = 2,
    max_smem: int = SMEM_PER_BLOCK_MAX,
    warp_specialized: bool = False,
) -> LaunchPlan:
    """Kernel configs of one call. Depends on shapes and static config only (CUDA graphs).

    kv_bytes: bytes per KV-cache element (2 for fp16/bf16, 1 for fp8). max_smem: shared memory
    per block of the device (`smem_per_block`). warp_specialized: the call's tensors and options
    can run Hopper's warp-specialized prefill kernel (`attention_prefill_ws.supports`); long
    prefills then take it. Memoized: every layer of a step asks the same question, and on the
    eager (piecewise-graph) path vLLM runs attention in, host time per layer is step time.
    """
    return _plan_launch(
        num_seqs, num_q_heads, num_kv_heads, head_size, max_query_len, sms,
        split_room(workspace), kv_bytes, max_smem, warp_specialized,
    )  # fmt: skip


def decode_schedules(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    qpos: int,
    sms: int,
    workspace: SplitRoom | None,
    kv_bytes: int,
    max_smem: int = SMEM_PER_BLOCK_MAX,
) -> list[tuple[float, int, int]]:
    """The decode schedules that fit one block's shared memory, as (wave fill of the unsplit
    batch, num_stages, split count with that schedule's program slots): 3 stages first, then
    the pipelined DECODE_STAGES_PIPELINED."""
    group = num_q_heads // num_kv_heads
    schedules = []
    for stages in (DECODE_STAGES, DECODE_STAGES_PIPELINED):
        block_m, tile_n, num_warps, _ = _decode_tile(qpos, group, head_size, stages)
        if decode_smem_bytes(block_m, tile_n, head_size, stages, kv_bytes) > max_smem:
            continue
        slots = sms * decode_programs_per_sm(
            block_m, tile_n, head_size, num_warps, stages, kv_bytes
        )
        splits = _num_splits(
            num_seqs, num_kv_heads, num_seqs * qpos, num_q_heads, head_size, slots, sms, workspace
        )
        schedules.append((wave_fill(num_seqs * num_kv_heads, slots), stages, splits))
    return schedules


@functools.lru_cache(maxsize=8192)
def _plan_launch(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_query_len: int,
    sms: int,
    workspace: SplitRoom | None,
    kv_bytes: int,
    max_smem: int,
    warp_specialized: bool,
) -> LaunchPlan:
    group = num_q_heads // num_kv_heads
    qpos_cap = max(1, min(DECODE_MAX_QUERY_LEN, DECODE_MAX_ROWS // group))
    decode_only = max_query_len <= qpos_cap
    # Two tile shapes only (one position, or the cap), so that every kernel variant a serving
    # run can meet is known in advance (see reachable_plans): speculative-verify batches of 2
    # to 8 positions run in the cap's tile, their unused rows masked.
    qpos = 1 if max_query_len <= 1 else qpos_cap
    # The pipelined schedule only for a batch it runs unsplit and fills the waves of clearly
    # better (see DECODE_STAGES_PIPELINED).
    candidates = decode_schedules(
        num_seqs, num_q_heads, num_kv_heads, head_size, qpos, sms, workspace, kv_bytes, max_smem
    )
    fill, num_stages, splits = candidates[0]
    if len(candidates) > 1 and candidates[1][2] == 1 and candidates[1][0] > fill + WAVE_FILL_MARGIN:
        fill, num_stages, splits = candidates[1]
    block_m, tile_n, num_warps, _ = _decode_tile(qpos, group, head_size, num_stages)
    decode = DecodeConfig(
        qpos=qpos,
        block_m=block_m,
        tile_n=tile_n,
        num_splits=splits,
        max_q=0 if decode_only else qpos_cap,
        num_warps=num_warps,
        num_stages=num_stages,
        head_fast=num_stages == DECODE_STAGES,
    )
    if warp_specialized and max_query_len <= 1:
        decode = _decode_ws_config(decode, num_seqs, num_q_heads, num_kv_heads, head_size, sms,
                                   workspace)  # fmt: skip
    prefill = None
    if not decode_only:
        # Programs of the large tile, at most: every sequence as long as the longest query.
        large_rows = _prefill_tile(group, head_size)[0]
        programs = num_seqs * num_kv_heads * cdiv(max_query_len * group, large_rows)
        block_m, block_n, num_warps, num_stages = _prefill_tile(
            group, head_size, programs, sms, max_smem, kv_bytes
        )
        ws = (
            warp_specialized
            and head_size in WS_RULE_HEAD_SIZES
            and block_m == large_rows
            and group <= PREFILL_WS_TILE[0]
        )
        if ws:
            block_m, block_n, num_warps, num_stages = PREFILL_WS_TILE
        prefill = PrefillConfig(
            block_m=block_m,
            block_n=block_n,
            min_q=qpos_cap,
            num_warps=num_warps,
            num_stages=num_stages,
            head_fast=PREFILL_HEAD_FAST,
            warp_specialized=ws,
        )
    return LaunchPlan(decode=decode, prefill=prefill)


def _decode_ws_config(
    triton_config: DecodeConfig,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    sms: int,
    workspace: SplitRoom | None,
) -> DecodeConfig:
    """The warp-specialized decode kernel's config for a decode-only batch it suits (one
    program per SM, at least DECODE_WS_MIN_SPLITS splits each), else `triton_config`."""
    group = num_q_heads // num_kv_heads
    pairs = num_seqs * num_kv_heads
    if workspace is None or head_size not in WS_RULE_HEAD_SIZES or group > DECODE_WS_ROWS:
        return triton_config
    # One query position per sequence.
    fit = workspace_splits(workspace, num_seqs * num_q_heads, head_size, pairs)
    splits = min(sms // pairs, fit, DECODE_WS_MAX_SPLITS)
    if splits < DECODE_WS_MIN_SPLITS:
        return triton_config
    tile_n, slots = DECODE_WS_TILE
    return DecodeConfig(
        qpos=1, block_m=DECODE_WS_ROWS, tile_n=tile_n, num_splits=splits, max_q=0, num_warps=4,
        num_stages=slots, head_fast=False, warp_specialized=True,
    )  # fmt: skip


def reachable_plans(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    sms: int,
    workspace: AttentionWorkspace | None,
    kv_bytes: int = 2,
    max_smem: int = SMEM_PER_BLOCK_MAX,
    warp_specialized: bool = False,
) -> list[LaunchPlan]:
    """One plan per compiled kernel variant `plan_launch` can choose for these heads, any batch
    (for `warm_up`). Split counts are not part of a variant: a split plan is given 2 splits."""
    group = num_q_heads // num_kv_heads
    qpos_cap = max(1, min(DECODE_MAX_QUERY_LEN, DECODE_MAX_ROWS // group))
    # Beyond this many sequences every plan is the unsplit 3-stage one.
    most_seqs = -(-NO_SPLIT_CTAS_PER_SM * sms // num_kv_heads) + 1
    plans: list[LaunchPlan] = []
    for max_query_len in (1, 2, qpos_cap + 1, 1 << 20):
        for num_seqs in range(1, most_seqs + 1):
            plan = plan_launch(
                num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_size=head_size, max_query_len=max_query_len, sms=sms,
                workspace=workspace, kv_bytes=kv_bytes, max_smem=max_smem,
                warp_specialized=warp_specialized,
            )  # fmt: skip
            dec = dataclasses.replace(plan.decode, num_splits=min(plan.decode.num_splits, 2))
            plan = dataclasses.replace(plan, decode=dec)
            if plan not in plans:
                plans.append(plan)
    return plans


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
            disable_hopper_kernels(f"{type(e).__name__} at start-up: {e}"[:500])
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


def _check_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    min_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Host-side checks (shapes, dtypes, devices, strides, scalars); never reads device data."""
    check_tensor("q", q, ndim=3, dtypes=SUPPORTED_Q_DTYPES, last_dim_contiguous=True)
    check_kernel_device("q", q)
    device = q.device
    num_tokens, num_q_heads, head_size = q.shape
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
    for name, value in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
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


def _skips_decode(plan: LaunchPlan, min_query_len: int, q: torch.Tensor) -> bool:
    """Whether this call can leave out the decode launch: its plan has a prefill launch and
    every non-empty sequence is longer than the decode kernel's positions (`min_query_len`,
    known on the host), so no program of the decode launch would find a row of its own. One
    launch fewer per layer on prefill steps, which vLLM runs eagerly. Never while a CUDA graph
    is captured: a replay may bring decode rows that the captured batch did not have."""
    if plan.prefill is None or min_query_len <= plan.prefill.min_q:
        return False
    return not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _refuse_unrunnable_ws(
    plan: LaunchPlan,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    max_query_len: int,
    sliding_window: int,
    softcap: float,
    has_sinks: bool,
) -> None:
    """Raise if a given plan (benchmark sweeps, tests) names a Hopper kernel this call cannot
    run; the rule's own plans take them only where `warp_specialized_ok` said yes."""
    dec, pre = plan.decode, plan.prefill
    ws_prefill = pre is not None and pre.warp_specialized
    if not (dec.warp_specialized or ws_prefill):
        return
    ok = warp_specialized_ok(q, key_cache, value_cache, sliding_window=sliding_window,
                             softcap=softcap, has_sinks=has_sinks)  # fmt: skip
    if dec.warp_specialized and not (ok and pre is None and dec.qpos == 1):
        what = "decode kernel runs decode-only batches (query_len 1) on sm_90 GPUs"
    elif ws_prefill and not ok:
        what = "prefill kernel runs sm_90 GPUs"
    else:
        return
    off = "" if _hopper_off is None else f" (off in this process: {_hopper_off})"
    raise ValueError(
        f"paged_attention: the warp-specialized {what}{off}, fp16/bf16 with a cache of the "
        f"same dtype, head sizes {_WS_HEAD_SIZES}, without sliding window, soft cap or sinks; "
        f"got max_query_len {max_query_len}, {q.device} {q.dtype} cache {key_cache.dtype} head "
        f"size {q.shape[2]}, window {sliding_window}, softcap {softcap}, sinks {has_sinks}"
    )


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
    # Triton 3.6's interpreter mis-multiplies bf16 in tl.dot (see attention_decode._mma); on
    # the CPU the kernels can only be running under it.
    upcast_dot = (q.device.type == "cpu" and q.dtype == torch.bfloat16) or q.dtype == torch.float32
    dec = plan.decode
    if dec.warp_specialized:
        split = dec.num_splits > 1
        decode_ws.launch_decode_ws(
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
        prefill_ws.launch_prefill_ws(
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


def paged_attention_reference(
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
) -> torch.Tensor:
    """fp32 torch definition of `paged_attention` (same arguments, minus the workspace).

    Gathers each sequence's pages, dequantizes fp8 (value = stored * scale), and computes
    softmax(mask(softcap(scale * q k^T)) [+ sink column]) v per query head in fp32. Reads the
    lengths on the host: a reference, not for the serving path.
    """
    del max_query_len, min_query_len, max_seq_len  # the reference needs no hints
    num_q_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    kv_fp8 = key_cache.dtype == FP8_E4M3
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, stop = cu[b], cu[b + 1]
        q_len = stop - start
        if q_len <= 0:
            continue
        pages = block_table[b, : (seq_len + block_size - 1) // block_size].long()
        k = key_cache[pages].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        v = value_cache[pages].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        if kv_fp8:
            k = k * k_scale.float().reshape(())
            v = v * v_scale.float().reshape(())
        k = k.repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qf = q[start:stop].float()  # [q_len, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qf, k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float()[:, None, None].expand(num_q_heads, q_len, 1)
            s = torch.cat([s, sink_col], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :seq_len]
        out[start:stop] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)
    return out

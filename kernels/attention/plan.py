"""The launch plan of a paged-attention call: which kernels, tiles, stages and split counts.

`plan_launch` decides from shapes only (batch size, heads, head size, longest query), so a CUDA
graph captured for one batch shape stays valid for any sequence lengths replayed into it.
Every constant of the rule says in a comment what it is for and which results file measured
it; the measurements themselves are in docs/tuning/attention.md. No autotuning: it would re-run
at every process start and delay the first request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .._checks import FP8_E4M3
from .._launch import cdiv, next_pow2
from .workspace import (
    SUPPORTED_HEAD_SIZES,
    AttentionWorkspace,
    SplitRoom,
    split_room,
    workspace_budget,
    workspace_splits,
)

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
# Measured and not taken (docs/tuning/attention.md): no split at all from SMs / 2 pairs on. It
# won on uniform batches (Llama-3-8B B=24 103 us against 114 at 4 splits, Qwen2.5-7B B=48 56
# against 73; decode-split-sweep-h200-2026-11-26.json) and lost up to 4x on ragged ones, where
# one long sequence unsplit is the whole launch (Qwen2.5-7B B=48 chat-like contexts 231 us
# against FlashInfer's 59; kernels-h200-2026-11-26-parts1-3.json).
# Batches of two or more sequences are cut by length, not per sequence (_balanced_budget):
# those the rule splits into as many pieces as their splits, those it does not split into at
# most BALANCED_UNSPLIT_PIECES per sequence more, up to BALANCED_UNSPLIT_MAX_SEQS sequences.
# Ragged batches gain far more than equal ones lose below that size, not above it
# (docs/tuning/attention.md, "Balanced split" and "The schedule, once per step").
BALANCED_UNSPLIT_PIECES = 1
BALANCED_UNSPLIT_MAX_SEQS = 128
# SM count assumed off-GPU (Triton interpreter): an H100 SXM / H200.
CPU_SM_COUNT = 132
# Largest grid extent on CUDA's second and third axes.
MAX_GRID_YZ = 65535


def supported_head_sizes() -> tuple[int, ...]:
    """Head sizes the kernels compile for (non-powers of two run in padded tiles)."""
    return SUPPORTED_HEAD_SIZES


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
    # Balanced split (> 0): the batch's KV tiles are cut into at most split_budget pieces of
    # equal size, however the lengths fall (a long sequence among short ones gets several, a
    # short one one), in num_seqs + split_budget programs per kv head; num_splits is then only
    # what a batch of equal lengths gets. 0: each sequence in num_splits equal parts.
    split_budget: int = 0
    # Hopper's warp-specialized kernel (decode_ws), decode-only batches: num_stages
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
    # Hopper's warp-specialized kernel (prefill_ws): num_stages is its ring of K/V
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


# Decode: 128 KV tokens per step, 4 warps; two schedules chosen by wave fill: 3 stages with two
# programs per SM (kv-head-fastest grid), or 5 stages with one program per SM and a K/V tile
# always in flight (seq-major grid), the latter only when it needs no split and fills the waves
# clearly better. Measured on an H200 (runs 2, 5-7; docs/tuning/attention.md).
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


# Prefill tiles by head size; the kv-head-fastest grid (every head's heaviest q blocks first)
# won at every length (H200 runs 2, 5, 6; docs/tuning/attention.md).
PREFILL_TILES = {  # head_pad bound -> (block_m, block_n, num_warps, num_stages)
    64: (128, 64, 4, 3),
    128: (256, 64, 16, 7),
    256: (64, 64, 8, 2),
}
# D <= 128: 256x64 tiles, 16 warps (four warpgroups of 64 rows sharing each K/V tile), 7 stages
# (two K/V tiles in flight, 193 KiB): 416.9 / 448.3 / 463.2 TFLOP/s at S = 4k / 8k / 16k on an
# H200 against 398.7 / 430.5 / 447.2 for 8 warps and 5 stages
# (attention-h200-2026-11-26-prefill-sweep*.json).
# A device whose block shared memory cannot hold a tile takes fewer stages, then the small tile
# (A100: 163 KiB per block; sm_89: 99 KiB).
PREFILL_STAGE_FALLBACKS = (5, 3)
# Hopper (prefill_ws.supports): the warp-specialized kernel's tile at head size <= 128, 256 rows
# in two compute warpgroups, 64 keys, 4 K/V slots: 465.9 / 508.7 / 529.3 TFLOP/s
# against the Triton kernel's 425.8 / 456.4 / 473.4 (attention-h200-2026-11-26-ws-sweep.json).
PREFILL_WS_TILE = (256, 64, 4, 4)  # (block_m, block_n, warps per compute warpgroup, slots)
# Head size 256: 128 rows (64 per compute warpgroup: its fp32 accumulator takes 128 of its 216
# registers, prefill_ws.WS_REGISTERS) and 2 slots: the 64 KiB Q tile and two 64 KiB K/V slots
# fill 192 KiB.
PREFILL_WS_TILE_D256 = (128, 64, 4, 2)
# Head sizes the rule gives either Hopper kernel, every cache dtype. At 256 the
# prefill kernel (soft cap, as Gemma 2) ran 1.17-2.31x faster than the Triton kernel's 64-row
# tile at S = 1k-32k, 2.02x with a 4096 window at S = 32k (H200,
# prefill-ws-sweep-nvidia-h200-2026-11-27-gemma-2-9b-*.json); at 128 windows and sinks cost it
# nothing against the Triton kernel (Mistral-7B's window: 1.9-3.9% faster at S = 4k-32k;
# Llama-3-8B with sinks 10% faster at 4k and 16k: ...-mistral-7b-*.json,
# ...-llama-3-8b-sinks.json).
WS_RULE_HEAD_SIZES = (128, 256)
# Head sizes the rule gives Hopper's prefill kernel with 16-bit caches only. 64 (Llama-3.2-1B's
# 32/8/64 on an H200): the 128-row tile 1.23 / 1.29x the Triton kernel at S = 512 / 1024, the
# 256-row tile 1.03-1.15x at S = 4k-32k and 0.98x at 2048 (58.5 against 57.7 µs)
# (prefill-ws-sweep-nvidia-h200-2026-11-27-llama-3.2-1b-plain-small-tile.json). An fp8 cache
# at 64 keeps the Triton kernel, faster from S = 4096 (233 against 254 µs;
# ...-llama-3.2-1b-plain-kvfp8-small-tile.json).
# Hopper's decode kernel at 64 trails the Triton kernel (B = 1 / 4: 26.8 / 61.7 against
# 24.5 / 55.7 µs, decode-split-sweep-nvidia-h200-2026-11-27-llama-3.2-1b.json).
WS_PREFILL_RULE_HEAD_SIZES_16BIT = (64,)
# Launches of fewer programs of its tile (every sequence as long as the longest query) than this
# fraction of the SMs keep the Triton kernel (its small tile), 3-17% faster there on an H200
# (Gemma-2-9B at 32-64 programs, S <= 512). From 112-128 programs on the Hopper kernel is faster:
# Gemma-2-9B at S = 1024 60.3 -> 52.3 µs (prefill-ws-sweep-nvidia-h200-2026-11-27-
# gemma-2-9b-softcap50-short.json). At head size <= 128 this applies to the 256-row tile only:
# launches the 128-row tile takes (below) have no lower bound.
PREFILL_WS_MIN_FILL = 0.75
# An fp8 cache: converting each K/V tile through registers costs the Hopper kernel its lead
# below about two waves of programs (Gemma-2-9B S = 1024, 128 programs: 72.9 µs against the
# Triton kernel's 68.9; S = 2048: 144.7 against 228.6).
PREFILL_WS_MIN_FILL_FP8 = 1.5
# Head size <= 128, launches of at most one wave of the 256-row tile (programs <= SMs): the
# 128-row tile, twice the programs. A causal prefill's programs differ in work (the last rows
# read every key), so one wave waits for its longest program; twice as many halve that tail.
# 1.24-1.58x at every such launch measured on an H200 (Llama-3-8B S = 1024 41.6 -> 33.6 µs),
# slower past one wave; one loss: a 1024-token chunk after 4096 cached tokens (no tail to
# halve), which shapes alone cannot tell apart. Tables and files: docs/tuning/attention.md,
# "Hopper prefill: the 128-row tile for short prompts, fp8 caches".
PREFILL_WS_SMALL_ROWS = 128


def prefill_ws_rule_applies(head_size: int, kv_bytes: int) -> bool:
    """Whether the prefill rule weighs Hopper's prefill kernel for this head size and cache."""
    return head_size in WS_RULE_HEAD_SIZES or (
        kv_bytes == 2 and head_size in WS_PREFILL_RULE_HEAD_SIZES_16BIT
    )


def prefill_ws_tile(head_size: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps per compute warpgroup, slots) of Hopper's prefill kernel."""
    return PREFILL_WS_TILE_D256 if head_size > 128 else PREFILL_WS_TILE


def prefill_ws_stage_buffers(head_size: int, kv_bytes: int) -> int:
    """Staging buffers of converted K/V tiles in Hopper's prefill kernel: none for a 16-bit
    cache; for fp8 two at head size <= 128 (the Q tile, four fp8 slots and two staged tiles:
    64 + 64 + 64 KiB), one at 256 (64 + 2 x 32 + 64 KiB: both compute warpgroups finish a tile
    before the next is staged)."""
    if kv_bytes == 2:
        return 0
    return 1 if head_size > 128 else 2


def prefill_ws_smem_bytes(
    block_m: int, block_n: int, head_size: int, slots: int, kv_bytes: int = 2
) -> int:
    """Shared memory of Hopper's prefill kernel (16-bit q): the Q tile, `slots` K and V tiles of
    the cache's dtype and, for fp8, the staging buffers of converted K and V tiles (its
    barriers, a few bytes, aside)."""
    staged = prefill_ws_stage_buffers(head_size, kv_bytes)
    tiles = block_m * 2 + 2 * slots * block_n * kv_bytes + 2 * staged * block_n * 2
    return tiles * head_size


def prefill_ws_config(
    num_q_heads: int, num_kv_heads: int, head_size: int, min_q: int,
    max_smem: int = SMEM_PER_BLOCK_MAX, kv_bytes: int = 2,
) -> PrefillConfig | None:  # fmt: skip
    """Hopper's prefill kernel's config for these heads (its tile for the head size, sequences
    of more than `min_q` query tokens), or None where it does not suit them: a query group
    larger than the tile, or a tile beyond `max_smem`. The rule takes it where
    `prefill_ws_rule_applies`, as `_prefill_ws_choice` says; the benchmarks time it everywhere
    it suits."""
    block_m, block_n, num_warps, slots = prefill_ws_tile(head_size)
    group = num_q_heads // num_kv_heads
    smem = prefill_ws_smem_bytes(block_m, block_n, head_size, slots, kv_bytes)
    if group > block_m or smem > max_smem:
        return None
    return PrefillConfig(
        block_m=block_m, block_n=block_n, min_q=min_q, num_warps=num_warps, num_stages=slots,
        head_fast=PREFILL_HEAD_FAST, warp_specialized=True,
    )  # fmt: skip


# Hopper, a decode-only batch of one sequence (nothing to balance) too small to fill the GPU:
# the warp-specialized decode kernel, one program per SM, splits = SMs // kv heads, 128-token
# tiles in 2 slots: B=1 ctx 32768 40.07 us against FlashInfer's 42.17 and the Triton kernel's
# 45.5 (attention-h200-2026-11-26-ws-decode.json). Batches of two or more sequences take the
# Triton kernel's balanced split instead: the decode kernel's equal splits leave SMs idle
# behind the longest sequence of a ragged batch (Llama-3-70B at TP 8, B=16 chat-like contexts
# 22.8 us against 13.4; Llama-3-8B B=4 21.2 against 16.2), where equal contexts pay 2.5-4.5%
# (decode-ws-balanced-sweep-h200-2026-11-27.json; 4-8% in the grid, docs/tuning/attention.md,
# "Hopper's decode kernel for one sequence only"). Not beyond DECODE_WS_MAX_SPLITS
# splits (fewer than 8 pairs): its one merging program then reads too many partials in turn
# (Llama-3-70B at TP 8, one kv head, B=1: 37.8 us at 64 splits, 32.0 at its best 24, against
# the Triton kernel's 21.9 at 64; Qwen2.5-7B B=1: 39.3 against 31.4;
# decode-split-sweep-h200-2026-11-26.json).
DECODE_WS_TILE = (128, 2)  # (tile_n, slots) of a bf16/fp16 cache at head size <= 128
# Tiles of the other caches the kernel runs (decode_ws_tile): head size 256 at 64 tokens (the
# same bytes per slot); an fp8 cache at the same tokens with more slots (half the bytes each,
# beside the two staging tiles of q's dtype).
DECODE_WS_TILE_D256 = (64, 2)
DECODE_WS_TILE_FP8 = (128, 4)
DECODE_WS_TILE_FP8_D256 = (64, 3)
# (head size, bytes per cache element) the rule gives the decode kernel: those measured
# faster than the Triton kernel in the grid's own runs (fuselane-ws / fuselane-triton rows,
# kernels-h200-2026-11-26-part1-decode.json): bf16 D=128 (Llama 1.06-1.12x, Mistral's
# window 1.20-1.40x, Qwen2.5 1.09-1.12x) and D=256 (Gemma-2 with soft cap 1.01-1.08x). Not
# fp8: staging through registers ran at 0.52-0.76x the Triton kernel (...-part2-decode_fp8).
DECODE_WS_RULE = frozenset({(128, 2), (256, 2)})
DECODE_WS_ROWS = 64  # the compute tile: one wgmma warpgroup's rows, >= query heads per kv head
DECODE_WS_MIN_SPLITS = 4
DECODE_WS_MAX_SPLITS = 16


def decode_ws_tile(head_size: int, kv_bytes: int) -> tuple[int, int]:
    """(tile_n, slots) of the warp-specialized decode kernel for this head size and cache."""
    if kv_bytes == 1:
        return DECODE_WS_TILE_FP8_D256 if head_size > 128 else DECODE_WS_TILE_FP8
    return DECODE_WS_TILE_D256 if head_size > 128 else DECODE_WS_TILE


def decode_ws_smem_bytes(tile_n: int, head_size: int, slots: int, kv_bytes: int,
                         q_bytes: int = 2) -> int:  # fmt: skip
    """Shared memory of the warp-specialized decode kernel: the 64-row Q tile, `slots` K and V
    tiles, and with an fp8 cache the two staging tiles of q's dtype (barriers not counted)."""
    q_tile = DECODE_WS_ROWS * head_size * q_bytes
    ring = slots * 2 * tile_n * head_size * kv_bytes
    staging = 2 * tile_n * head_size * q_bytes if kv_bytes == 1 else 0
    return q_tile + ring + staging


PREFILL_HEAD_FAST = True
# Short prefills: below PREFILL_MIN_PROGRAMS x SMs programs of the large tile, the 128-row tile
# (twice the programs; 256-row tiles left SMs idle at 512-token prompts, docs/tuning/attention.md).
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
    decode_warp_specialized: bool | None = None,
) -> LaunchPlan:
    """Kernel configs of one call. Depends on shapes and static config only (CUDA graphs).

    kv_bytes: bytes per KV-cache element (2 for fp16/bf16, 1 for fp8). max_smem: shared memory
    per block of the device (`smem_per_block`). warp_specialized: the call's tensors and options
    can run Hopper's warp-specialized prefill kernel (`prefill_ws.supports`); long
    prefills then take it. decode_warp_specialized: likewise for the decode kernel
    (`decode_ws.supports`; None: as `warp_specialized`); a decode-only batch of one sequence
    takes it.
    Memoized: every layer of a step asks the same question, and on the eager
    (piecewise-graph) path vLLM runs attention in, host time per layer is step time.
    """
    return _plan_launch(
        num_seqs, num_q_heads, num_kv_heads, head_size, max_query_len, sms,
        split_room(workspace), kv_bytes, max_smem, warp_specialized,
        warp_specialized if decode_warp_specialized is None else decode_warp_specialized,
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
    decode_warp_specialized: bool,
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
    budget = _balanced_budget(num_seqs, num_q_heads, num_kv_heads, head_size, qpos, splits,
                              workspace)  # fmt: skip
    if budget == 0 and (
        len(candidates) > 1 and candidates[1][2] == 1 and candidates[1][0] > fill + WAVE_FILL_MARGIN
    ):
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
        split_budget=budget,
    )
    if decode_warp_specialized and max_query_len <= 1:
        decode = _decode_ws_config(decode, num_seqs, num_q_heads, num_kv_heads, head_size, sms,
                                   workspace, kv_bytes, max_smem)  # fmt: skip
    prefill = None
    if not decode_only:
        # Programs of the large tile, at most: every sequence as long as the longest query.
        large_rows = _prefill_tile(group, head_size)[0]
        programs = num_seqs * num_kv_heads * cdiv(max_query_len * group, large_rows)
        block_m, block_n, num_warps, num_stages = _prefill_tile(
            group, head_size, programs, sms, max_smem, kv_bytes
        )
        prefill = PrefillConfig(
            block_m=block_m,
            block_n=block_n,
            min_q=qpos_cap,
            num_warps=num_warps,
            num_stages=num_stages,
            head_fast=PREFILL_HEAD_FAST,
        )
        if warp_specialized and prefill_ws_rule_applies(head_size, kv_bytes):
            ws = prefill_ws_config(num_q_heads, num_kv_heads, head_size, qpos_cap, max_smem,
                                   kv_bytes)  # fmt: skip
            if ws is not None:
                prefill = _prefill_ws_choice(ws, prefill, num_seqs * num_kv_heads, group,
                                             max_query_len, sms, kv_bytes)  # fmt: skip
    return LaunchPlan(decode=decode, prefill=prefill)


def _prefill_ws_choice(
    ws: PrefillConfig,
    triton: PrefillConfig,
    pairs: int,
    group: int,
    max_query_len: int,
    sms: int,
    kv_bytes: int,
) -> PrefillConfig:
    """The rule between Hopper's prefill kernel (`ws`, its tile for the head size) and the
    Triton kernel's config for `pairs` (sequence, kv head) pairs, each counted as long as the
    longest query: the 128-row tile where the 256-row one fills at most one wave
    (PREFILL_WS_SMALL_ROWS), else the Hopper kernel from PREFILL_WS_MIN_FILL (fp8: _FP8) x SMs
    programs on."""
    programs = pairs * cdiv(max_query_len * group, ws.block_m)
    if ws.block_m > PREFILL_WS_SMALL_ROWS >= group and programs <= sms:
        return dataclasses.replace(ws, block_m=PREFILL_WS_SMALL_ROWS)
    min_fill = PREFILL_WS_MIN_FILL if kv_bytes == 2 else PREFILL_WS_MIN_FILL_FP8
    return ws if programs >= min_fill * sms else triton


def _balanced_budget(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    qpos: int,
    splits: int,
    workspace: SplitRoom | None,
) -> int:
    """The balanced split's budget for a batch the 3-stage schedule splits `splits` ways (1:
    not at all): as many pieces as those splits (a batch of equal lengths is cut as before),
    or BALANCED_UNSPLIT_PIECES per sequence for a batch it does not split (a long sequence among
    short ones still gets pieces) of up to BALANCED_UNSPLIT_MAX_SEQS sequences, at most what the
    workspace holds; 0 (no balanced split) for one sequence (nothing to balance: the plain
    split, without a schedule) and larger unsplit batches."""
    if workspace is None or num_seqs < 2:
        return 0
    if splits < 2 and num_seqs > BALANCED_UNSPLIT_MAX_SEQS:
        return 0
    room = workspace_budget(workspace, qpos, num_q_heads, next_pow2(head_size), num_seqs,
                            num_kv_heads)  # fmt: skip
    pieces = splits if splits >= 2 else BALANCED_UNSPLIT_PIECES
    return min(num_seqs * pieces, room)


def _decode_ws_config(
    triton_config: DecodeConfig,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    sms: int,
    workspace: SplitRoom | None,
    kv_bytes: int,
    max_smem: int,
) -> DecodeConfig:
    """`decode_ws_config` for a batch of one sequence whose head size and cache are
    DECODE_WS_RULE's, else `triton_config`."""
    if num_seqs != 1 or (head_size, kv_bytes) not in DECODE_WS_RULE:
        return triton_config
    ws = decode_ws_config(num_seqs, num_q_heads, num_kv_heads, head_size, sms, workspace,
                          kv_bytes, max_smem)  # fmt: skip
    return triton_config if ws is None else ws


def decode_ws_config(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    sms: int,
    workspace: SplitRoom | AttentionWorkspace | None,
    kv_bytes: int,
    max_smem: int = SMEM_PER_BLOCK_MAX,
) -> DecodeConfig | None:
    """The warp-specialized decode kernel's config for a decode-only batch of this shape, or
    None where it does not suit it: one program per SM with DECODE_WS_MIN_SPLITS to
    DECODE_WS_MAX_SPLITS splits each, a workspace for them, at most DECODE_WS_ROWS query heads
    per kv head, the tiles within `max_smem`. The rule takes it for the head sizes and caches of
    DECODE_WS_RULE; the benchmarks time it everywhere it suits."""
    if isinstance(workspace, AttentionWorkspace):
        workspace = split_room(workspace)
    group = num_q_heads // num_kv_heads
    pairs = num_seqs * num_kv_heads
    tile_n, slots = decode_ws_tile(head_size, kv_bytes)
    if (
        workspace is None
        or group > DECODE_WS_ROWS
        or decode_ws_smem_bytes(tile_n, head_size, slots, kv_bytes) > max_smem
    ):
        return None
    # One query position per sequence.
    fit = workspace_splits(workspace, num_seqs * num_q_heads, head_size, pairs)
    splits = min(sms // pairs, fit)
    if not DECODE_WS_MIN_SPLITS <= splits <= DECODE_WS_MAX_SPLITS:
        return None
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
    decode_warp_specialized: bool | None = None,
) -> list[LaunchPlan]:
    """One plan per compiled kernel variant `plan_launch` can choose for these heads, any batch
    (for `warm_up`). Split counts and budgets are not part of a variant (runtime arguments): a
    split plan is given 2 splits, a balanced one a budget of 2."""
    group = num_q_heads // num_kv_heads
    qpos_cap = max(1, min(DECODE_MAX_QUERY_LEN, DECODE_MAX_ROWS // group))
    # Beyond this many sequences every plan is the unsplit 3-stage one: no balanced split past
    # BALANCED_UNSPLIT_MAX_SEQS, and from 1 / WAVE_FILL_MARGIN - 1 waves of the 3-stage slots
    # on its fill is within the margin of any other (so 5 stages are never taken).
    waves = round(1 / WAVE_FILL_MARGIN)
    most_seqs = max(cdiv(waves * NO_SPLIT_CTAS_PER_SM * sms, num_kv_heads),
                    BALANCED_UNSPLIT_MAX_SEQS) + 1  # fmt: skip
    plans: list[LaunchPlan] = []
    for max_query_len in (1, 2, qpos_cap + 1, 1 << 20):
        for num_seqs in range(1, most_seqs + 1):
            plan = plan_launch(
                num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_size=head_size, max_query_len=max_query_len, sms=sms,
                workspace=workspace, kv_bytes=kv_bytes, max_smem=max_smem,
                warp_specialized=warp_specialized, decode_warp_specialized=decode_warp_specialized,
            )  # fmt: skip
            dec = dataclasses.replace(
                plan.decode,
                num_splits=min(plan.decode.num_splits, 2),
                split_budget=min(plan.decode.split_budget, 2),
            )
            plan = dataclasses.replace(plan, decode=dec)
            if plan not in plans:
                plans.append(plan)
    return plans

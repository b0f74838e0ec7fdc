"""Launch rules of the KV write (no autotuning: it would re-run at every process start and
delay the first request) and the host-side addressing choices (int32 or int64 offsets, flat
slots)."""

from __future__ import annotations

import functools

import torch

from .._launch import next_pow2

# Tokens per program for the plain write, keyed by the number of rows N (first bound >= N wins).
# Measured on an H200 (fuselane run 1, 2026-11-21; bench_kv_cache.py's kv_write_sweep: CUDA-graph
# replay, median of 50 replays of 20 calls; Hkv=8, D=128, page 16, bf16; docs/tuning/kv_cache.md):
#   1 token      1 or 2 tokens/program at 2-8 warps: 1.38-1.57 us, the rule's setting 1.33 us and
#                1.42 us in two sections of the same run (noise ~0.09 us) -> 1 token, 4 warps
#   256 tokens   1-4 tokens/program 1.82-1.96 us; 8 or 16: 2.26-3.23 us -> 1
#   4096 tokens  8 tokens x 8 warps 5.78 us best (2 x 4, the old rule, 5.87; 16 x 8 5.82) -> 8
#   32768 tokens every setting 68.3-71.4 us, within noise; 8 x 8 69.0 -> 8
# Between 512 and 4096 nothing was measured yet; the sweep now also times 1024 and 2048 tokens.
_WRITE_ROWS_PER_PROGRAM: tuple[tuple[int, int], ...] = (
    (512, 1),
    (2048, 2),
    (1 << 62, 8),
)
# Elements of K (and as many of V) one program moves per tensor: bounds the registers (8192 bf16
# elements over 256 threads is 32 per thread per tensor) for large Hkv * D.
_WRITE_MAX_TILE_ELEMS = 8192
# Warps: one 16-byte access per thread per tensor per row needs ROWS * TILE / 8 threads; 4 warps
# cover a 2048-element program (e.g. 2 tokens of Hkv=8, D=128), 8 warps anything larger (the
# measured best at 4096 tokens, 8 tokens x 8 warps).
_WRITE_WARPS_SMALL, _WRITE_WARPS_LARGE, _WRITE_WARPS_THRESHOLD = 4, 8, 2048
# Key/value loads: read once, so they may be evicted first; cache stores keep the default policy
# (the attention kernel reads the new rows right after). "" = default. Unmeasured: the sweep
# times both at every size.
_WRITE_LOAD_EVICTION = ""


def _write_launch_config(
    num_rows: int, row_elems: int, rows_per_program: int | None = None
) -> tuple[int, int, int]:
    """(rows per program, tile, warps) for the plain write; see the tables above."""
    if rows_per_program is None:
        rows_per_program = next(r for bound, r in _WRITE_ROWS_PER_PROGRAM if num_rows <= bound)
    tile = min(next_pow2(row_elems), max(16, _WRITE_MAX_TILE_ELEMS // rows_per_program))
    warps = (
        _WRITE_WARPS_SMALL
        if rows_per_program * tile <= _WRITE_WARPS_THRESHOLD
        else _WRITE_WARPS_LARGE
    )
    return rows_per_program, tile, warps


def _rope_num_warps(q_heads_p2: int, half_rot_p2: int) -> int:
    """4 warps while each q half-tile is <= 2048 elements (Hq=32, rot=128), else 8. Not yet
    measured on GPU."""
    return 4 if q_heads_p2 * half_rot_p2 <= 2048 else 8


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


_INT32_MAX = 2**31 - 1


def _offset_bound(t: torch.Tensor, rows: int | None = None) -> int:
    """An upper bound of |element offset| the kernels form from t's first element: `rows` rows
    along dim 0 (default t's own), every other dim padded to twice its size (the power-of-two
    tiles' masked lanes: next_power_of_2(n) < 2n). Valid slots and positions are the caller's
    contract (< num_blocks * block_size, < max_position), so they stay inside these bounds."""
    shape = t.shape
    return _shape_offset_bound(shape, t.stride(), shape[0] if rows is None else rows)


@functools.lru_cache(maxsize=4096)
def _shape_offset_bound(shape: tuple[int, ...], stride: tuple[int, ...], rows: int) -> int:
    # Memoized: every layer of every step asks about the same few shapes (host time per
    # launch is step time on vLLM's eager path).
    bound = max(max(rows, shape[0]) - 1, 0) * abs(stride[0])
    return bound + sum((2 * n - 1) * abs(st) for n, st in zip(shape[1:], stride[1:], strict=True))


def _needs_int64(*bounds: int) -> bool:
    """True unless every offset bound fits in int32 (then the kernels compute offsets in int32:
    ~40% fewer instructions in the write kernel, and one multiply from slot to store)."""
    return max(bounds) > _INT32_MAX


def _flat_slots(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Block stride == block_size * slot stride in both caches (vLLM's default NHD layouts, not
    HND or cross-layer ones): slot * slot_stride addresses the slot without a division."""
    return all(
        c.shape[0] <= 1 or c.stride(0) == c.shape[1] * c.stride(1) for c in (key_cache, value_cache)
    )

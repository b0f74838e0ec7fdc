"""The decode kernel's balanced split: which piece of which sequence each program takes.

A split decode launch of `num_seqs + budget` programs per kv head (`DecodeConfig.split_budget`)
cuts the batch's KV tiles into pieces of at most cdiv(total, budget) tiles, each sequence into
equal pieces, numbered sequence by sequence; every program computes its own (sequence, piece,
pieces) from the batch's lengths on the device (`balanced_piece`, called at the top of
`decode._decode_kernel`), so a CUDA graph replays it for any lengths. `balanced_pieces` is the
same count on the host, for tests and the workspace bound (`workspace.workspace_budget`).
Measurements and the rule: docs/tuning/attention.md, "Balanced split".
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import cdiv

# Sequences scanned per step by the balanced split's schedule (vLLM's default max_num_seqs in one).
BALANCE_SCAN = tl.constexpr(256)
# Larger than any piece index: the "no sequence above" value of the schedule's search.
NO_PIECE = tl.constexpr(1 << 30)


@triton.jit
def _seq_tiles(s, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N: tl.constexpr, MAX_Q: tl.constexpr,
               SLIDING_WINDOW: tl.constexpr):  # fmt: skip
    """KV tiles the balanced split counts for each sequence of the vector `s` (0 past the batch).

    Only the counts' consistency matters for exactness: every program of a sequence derives
    the same piece count from them and cuts its own exact tile range into that many pieces.
    A decode-only launch (MAX_Q == 0) reads seq_lens alone (one load per program, not three):
    padding requests have length 0, and a window is counted as for one query token. With
    prefill chunks in the batch (MAX_Q > 0) their sequences, which are the prefill kernel's,
    count 0 and take no piece."""
    ok = s < num_seqs
    seq_len = tl.load(seq_lens_ptr + s, mask=ok, other=0)
    q_len = tl.full(s.shape, 1, tl.int32)
    if MAX_Q > 0:
        q_end = tl.load(cu_q_ptr + s + 1, mask=ok, other=0)
        q_len = q_end - tl.load(cu_q_ptr + s, mask=ok, other=0)
    kv_lo = tl.zeros_like(seq_len)
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(seq_len - q_len - SLIDING_WINDOW + 1, 0)
    tiles = tl.cdiv(seq_len, TILE_N) - kv_lo // TILE_N
    own = (seq_len > 0) & (tiles > 0)
    if MAX_Q > 0:
        own = own & (q_len > 0) & (q_len <= MAX_Q)
    return tl.where(own, tiles, 0)


@triton.jit
def _find_piece(tiles, chunk, item, done):
    """Over one block of sequences: how many end their pieces at or before `item`, the largest
    such end, the smallest end above it, and the pieces of the block and all before it."""
    ends = tl.cumsum(tl.cdiv(tiles, chunk), 0) + done
    before = ends <= item
    count = tl.sum(before.to(tl.int32), 0)
    first = tl.max(tl.where(before, ends, 0), 0)
    end = tl.min(tl.where(before, NO_PIECE, ends), 0)
    return count, first, end, tl.max(ends, 0)


@triton.jit
def balanced_piece(item, num_seqs, budget, cu_q_ptr, seq_lens_ptr, TILE_N: tl.constexpr,
                    MAX_Q: tl.constexpr, SLIDING_WINDOW: tl.constexpr):  # fmt: skip
    """(sequence, piece, pieces) of program `item` under the balanced split, computed by every
    program from the batch's lengths (nothing on the host: a CUDA graph replays it for any
    lengths). The batch's KV tiles are cut into pieces of at most chunk = cdiv(total, budget)
    tiles, each sequence into cdiv(tiles, chunk) equal pieces, numbered sequence by sequence.
    Sum over sequences of cdiv(tiles, chunk) <= total / chunk + num_seqs <= budget + num_seqs:
    the launch's item count. An item past the last piece gets a sequence >= num_seqs.

    The item's sequence is the number of sequences whose pieces all come before it (ends <=
    item), its first piece the largest such end, its last + 1 the smallest end above it. A
    batch of up to BALANCE_SCAN sequences is one load; a larger one two passes of blocks."""
    offs = tl.arange(0, BALANCE_SCAN)
    if num_seqs <= BALANCE_SCAN:
        tiles = _seq_tiles(offs, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N, MAX_Q, SLIDING_WINDOW)
        chunk = tl.maximum(tl.cdiv(tl.sum(tiles, 0), budget), 1)
        seq, first, end, _ = _find_piece(tiles, chunk, item, 0)
    else:
        total = 0
        for s0 in range(0, num_seqs, BALANCE_SCAN):
            tiles = _seq_tiles(s0 + offs, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N, MAX_Q,
                               SLIDING_WINDOW)  # fmt: skip
            total += tl.sum(tiles, 0)
        chunk = tl.maximum(tl.cdiv(total, budget), 1)
        seq = 0
        first = 0
        end = NO_PIECE
        done = 0
        for s0 in range(0, num_seqs, BALANCE_SCAN):
            tiles = _seq_tiles(s0 + offs, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N, MAX_Q,
                               SLIDING_WINDOW)  # fmt: skip
            count, block_first, block_end, done = _find_piece(tiles, chunk, item, done)
            seq += count
            first = tl.maximum(first, block_first)
            end = tl.minimum(end, block_end)
    return seq, item - first, end - first


def balanced_pieces(tiles: list[int], budget: int) -> list[int]:
    """Pieces per sequence of the decode kernel's balanced split (`DecodeConfig.split_budget`),
    as its programs compute them on the device from the sequences' KV tiles: pieces of at most
    cdiv(total, budget) tiles, so their sum is at most budget + len(tiles)."""
    chunk = max(cdiv(sum(tiles), budget), 1)
    return [cdiv(t, chunk) for t in tiles]

"""The decode kernel's balanced split: which piece of which sequence each program takes.

A split decode launch of `num_seqs + budget` programs per kv head (`DecodeConfig.split_budget`)
cuts the batch's KV tiles into pieces of at most cdiv(total, budget) tiles, each sequence into
equal pieces, numbered sequence by sequence. `_schedule_kernel` writes each program's (sequence,
piece, pieces) from the batch's lengths on the device into a slot of the workspace, once per
step and launch shape (`balanced_schedule`: the step's first layer launches it, its other
layers read the same slot), so a CUDA graph that captured it replays it for any lengths.
`balanced_pieces` is the same count on the host, for tests and the workspace bound
(`workspace.workspace_budget`).
Measurements and the rule: docs/tuning/attention.md, "Balanced split".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from .._launch import cdiv, keep_with_recording, launch, unrecorded
from .workspace import SCHEDULE_ENTRY

if TYPE_CHECKING:
    from .args import PagedBatch
    from .workspace import AttentionWorkspace

# Sequences read per block by the schedule kernel (vLLM's default max_num_seqs in one).
BALANCE_SCAN = tl.constexpr(256)
# Programs of the decode launch each program of the schedule kernel writes the entry of.
SCHEDULE_ITEMS = 32
# Larger than any piece index: the "no sequence above" value of the schedule's search.
NO_PIECE = tl.constexpr(1 << 30)
ENTRY = tl.constexpr(SCHEDULE_ENTRY)  # int32 per entry (workspace.SCHEDULE_ENTRY)


@triton.jit
def _seq_tiles(s, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N: tl.constexpr, MAX_Q: tl.constexpr,
               SLIDING_WINDOW: tl.constexpr):  # fmt: skip
    """KV tiles the balanced split counts for each sequence of the vector `s` (0 past the batch).

    Only the counts' consistency matters for exactness: every program of a sequence gets the
    same piece count and cuts its own exact tile range into that many pieces. A decode-only
    launch (MAX_Q == 0) reads seq_lens alone: padding requests have length 0, and a window is
    counted as for one query token. With prefill chunks in the batch (MAX_Q > 0) their
    sequences, which are the prefill kernel's, count 0 and take no piece."""
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


@triton.jit(do_not_specialize=["num_seqs", "budget", "items"])
def _schedule_kernel(
    sched_ptr,  # [items, ENTRY] int32 out: (sequence, piece, pieces, 0) of each decode program
    cu_q_ptr,  # [num_seqs + 1] int32 (read if MAX_Q > 0)
    seq_lens_ptr,  # [num_seqs] int32
    num_seqs,
    budget,
    items,  # num_seqs + budget: the decode launch's programs per kv head
    TILE_N: tl.constexpr,
    MAX_Q: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    ITEMS: tl.constexpr,  # entries per program
    SCAN: tl.constexpr,  # sequences per block
):
    """Each program fills ITEMS entries. The batch's tiles are cut into pieces of at most
    chunk = cdiv(total, budget) tiles, sequence s into cdiv(tiles_s, chunk); sum <= budget +
    num_seqs, so every piece has an item. Item i's sequence is the number of sequences whose
    pieces all end at or before i (ends <= i: zero-piece sequences before it included, those
    right after it not), its first piece the largest such end, its last + 1 the smallest end
    above it. An item past the last piece gets a sequence >= num_seqs (nothing to do)."""
    item = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    offs = tl.arange(0, SCAN)
    total = 0
    for s0 in range(0, num_seqs, SCAN):
        tiles = _seq_tiles(s0 + offs, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N, MAX_Q,
                           SLIDING_WINDOW)  # fmt: skip
        total += tl.sum(tiles, 0)
    chunk = tl.maximum(tl.cdiv(total, budget), 1)
    seq = tl.zeros([ITEMS], tl.int32)
    first = tl.zeros([ITEMS], tl.int32)
    end = tl.full([ITEMS], NO_PIECE, tl.int32)
    done = 0
    for s0 in range(0, num_seqs, SCAN):
        tiles = _seq_tiles(s0 + offs, num_seqs, cu_q_ptr, seq_lens_ptr, TILE_N, MAX_Q,
                           SLIDING_WINDOW)  # fmt: skip
        ends = tl.cumsum(tl.cdiv(tiles, chunk), 0) + done
        before = ends[None, :] <= item[:, None]
        seq += tl.sum(before.to(tl.int32), 1)
        first = tl.maximum(first, tl.max(tl.where(before, ends[None, :], 0), 1))
        end = tl.minimum(end, tl.min(tl.where(before, NO_PIECE, ends[None, :]), 1))
        done = tl.max(ends, 0)
    ok = item < items
    row = sched_ptr + item * ENTRY
    tl.store(row, seq, mask=ok)
    tl.store(row + 1, item - first, mask=ok)
    tl.store(row + 2, end - first, mask=ok)
    tl.store(row + 3, tl.zeros_like(item), mask=ok)


class _ScheduleKey(NamedTuple):
    """What a batch's schedule is kept under (`PagedBatch.schedules`)."""

    workspace: int  # id of the workspace whose slot holds it
    budget: int
    tile_n: int
    max_q: int
    window: int
    versions: tuple[int, int]  # `PagedBatch.lengths_version()` when it was written
    capturing: bool  # written inside a CUDA-graph capture


def balanced_schedule(
    batch: PagedBatch,
    workspace: AttentionWorkspace,
    budget: int,
    tile_n: int,
    max_q: int,
    window: int,
) -> torch.Tensor:
    """The [num_seqs + budget, ENTRY] int32 schedule of a balanced decode launch of `batch`: a
    view of one of the workspace's `SCHEDULE_SLOTS` slots (nothing allocated).

    Written once per batch and launch shape: the step's later layers (same batch, same tile,
    budget and window) read the slot the first one wrote. The batch remembers the slot under
    its shape, the versions of its length tensors (an in-place update writes it again) and
    whether a CUDA graph is being captured (a slot written inside a capture is the graph's: its
    replays write it; one written outside is not, so neither is read by the other; an eager
    call forgets those written in a capture, so a batch captured again after an eager warm-up,
    as benchmarks time graphs, launches its own into the new graph). The workspace remembers
    which batch wrote each slot last: a slot another batch has taken since is written again,
    into the next slot. vLLM builds one `PagedBatch` per step and reads it only within it, far
    fewer than SCHEDULE_SLOTS steps.

    The launch is left out of any launch recording (`_launch.unrecorded`): a replay for a later
    layer reads the slot and must not write it again; the recording keeps the view
    (`_launch.keep_with_recording`), and the unchecked entry point replays only while
    `schedules_hold`.
    """
    cu_q, seq_lens = batch.cu_seqlens_q, batch.seq_lens
    capturing = seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
    schedules = batch.schedules
    if not capturing and schedules:
        for key in [k for k in schedules if k.capturing]:
            del schedules[key]
    key = _ScheduleKey(id(workspace), budget, tile_n, max_q, window, batch.lengths_version(),
                       capturing)  # fmt: skip
    slots = workspace.schedule_slots
    held = schedules.get(key)
    if held is not None and slots.owners[held[1]] is held:
        table = held[0]
    else:
        num_seqs = seq_lens.shape[0]
        items = num_seqs + budget
        if items > workspace.schedule.shape[1]:
            raise ValueError(
                f"split_budget: {budget} pieces for {num_seqs} sequences need {items} schedule "
                f"entries; the workspace holds at most {workspace.schedule.shape[1]} "
                f"(max_num_tokens x max_splits)"
            )
        slot = slots.claim()
        table = workspace.schedule[slot, :items]
        held = slots.owners[slot] = schedules[key] = (table, slot)
        with unrecorded():
            launch(
                _schedule_kernel,
                (cdiv(items, SCHEDULE_ITEMS),),
                table,
                cu_q,
                seq_lens,
                num_seqs,
                budget,
                items,
                TILE_N=tile_n,
                MAX_Q=max_q,
                SLIDING_WINDOW=window,
                ITEMS=SCHEDULE_ITEMS,
                SCAN=BALANCE_SCAN.value,
                num_warps=4,
            )
    keep_with_recording(table)
    return table


def schedules_hold(batch: PagedBatch, workspace: AttentionWorkspace | None) -> bool:
    """Whether every schedule `batch` wrote into `workspace` for its lengths as they are is
    still in its slot (a replay of its launches may read them)."""
    if not batch.schedules or workspace is None:
        return True
    owners = workspace.schedule_slots.owners
    versions = batch.lengths_version()
    return all(
        owners[held[1]] is held
        for key, held in batch.schedules.items()
        if key.workspace == id(workspace) and key.versions == versions
    )


def balanced_pieces(tiles: list[int], budget: int) -> list[int]:
    """Pieces per sequence of the decode kernel's balanced split (`DecodeConfig.split_budget`),
    as the schedule kernel computes them on the device from the sequences' KV tiles: pieces of
    at most cdiv(total, budget) tiles, so their sum is at most budget + len(tiles)."""
    chunk = max(cdiv(sum(tiles), budget), 1)
    return [cdiv(t, chunk) for t in tiles]

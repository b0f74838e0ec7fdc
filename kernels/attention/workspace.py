"""The split-KV workspace of paged attention: the scratch a split launch writes its partial
outputs into, allocated once per engine, and what the launch rule needs to know of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import check_choice
from .._launch import next_pow2

SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
DEFAULT_MAX_SPLITS = 64
# Balanced-split schedules a workspace holds at once (`balance.balanced_schedule`): a step
# writes one per launch shape, and a batch is read only within its step, so a few suffice.
SCHEDULE_SLOTS = 4
# int32 per schedule entry: (sequence, piece, pieces, unused), one 16-byte line.
SCHEDULE_ENTRY = 4


@dataclass
class ScheduleSlots:
    """Host bookkeeping of a workspace's schedule slots: which batch's schedule each holds
    (`owners[slot]`, the holder's token, see `balance.balanced_schedule`) and the slot the next
    schedule goes to (`next`, round robin)."""

    owners: list = field(default_factory=lambda: [None] * SCHEDULE_SLOTS)
    next: int = 0

    def claim(self) -> int:
        """The slot for a new schedule (its caller records the holder in `owners`)."""
        slot = self.next
        self.next = (slot + 1) % SCHEDULE_SLOTS
        return slot


@dataclass(frozen=True)
class AttentionWorkspace:
    """Split-KV scratch, allocated once per engine and reused by every layer and step.

    partial_out: [max_num_tokens * num_q_heads * max_splits * head_pad] fp32
    partial_ml:  [max_num_tokens * num_q_heads * max_splits * 2] fp32 (running max, sum)
    counters:    [max_num_tokens * num_q_heads] int32, zero between launches: the fused merge
                 counts the finished splits of each (sequence, kv head) and resets its count
    schedule:    [SCHEDULE_SLOTS, max_items, SCHEDULE_ENTRY] int32: balanced-split schedules
                 (max_items: the most programs per kv head a balanced launch fits, the partial
                 columns of one query position); `schedule_slots` says which batch and launch
                 shape wrote each slot last (host state, see `balance.balanced_schedule`)

    A call uses `num_seqs * qpos * Hq * num_splits` partial rows (qpos: the decode tile's query
    positions, 1 for plain decode); when that does not fit, the call runs with fewer splits. The
    fit depends on shapes only, so CUDA graphs stay valid.
    """

    partial_out: torch.Tensor
    partial_ml: torch.Tensor
    counters: torch.Tensor
    schedule: torch.Tensor
    max_num_tokens: int
    num_q_heads: int
    head_size: int
    max_splits: int
    schedule_slots: ScheduleSlots = field(default_factory=ScheduleSlots, compare=False, repr=False)

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
        counters and SCHEDULE_SLOTS * max_num_tokens * max_splits * 16 bytes of balanced-split
        schedules.
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
        max_items = max_num_tokens * max_splits  # partial columns at one query position
        return cls(
            partial_out=torch.empty(rows * head_pad, dtype=torch.float32, device=device),
            partial_ml=torch.empty(rows * 2, dtype=torch.float32, device=device),
            counters=torch.zeros(max_num_tokens * num_q_heads, dtype=torch.int32, device=device),
            schedule=torch.empty(
                SCHEDULE_SLOTS, max_items, SCHEDULE_ENTRY, dtype=torch.int32, device=device
            ),
            max_num_tokens=max_num_tokens,
            num_q_heads=num_q_heads,
            head_size=head_size,
            max_splits=max_splits,
        )


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


def workspace_budget(
    workspace: SplitRoom, qpos: int, num_q_heads: int, head_pad: int, num_seqs: int,
    num_kv_heads: int,
) -> int:  # fmt: skip
    """Largest split budget of a balanced split (`DecodeConfig.split_budget`) `workspace` holds
    for `num_seqs` sequences: partials of `qpos` x `num_q_heads` rows for each of the launch's
    num_seqs + budget programs and a counter per (sequence, kv head); 0 if none fits. (No
    sequence gets more pieces than the budget.)"""
    if workspace.counters < num_seqs * num_kv_heads:
        return 0
    items = min(
        workspace.partial_out // (qpos * num_q_heads * head_pad),
        workspace.partial_ml // (qpos * num_q_heads * 2),
    )
    return max(0, items - num_seqs)

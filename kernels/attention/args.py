"""The argument bundles of paged attention, and the flat public signature written once.

Inside the package a call travels as `(q, key_cache, value_cache, out, batch, options,
workspace)`: `PagedBatch` is the step's layout over the cache (the same for every layer of a
step), `AttentionOptions` the layer's options. The flat keyword form users call
(`paged_attention(q, ..., block_table, max_query_len=..., scale=...)`) is defined here once,
by `flat_arguments`, for the checked, unchecked and reference entry points alike; the custom
op flattens the bundles once more at the `torch.library` boundary (`ops.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .plan import AttentionWorkspace


@dataclass(frozen=True)
class PagedBatch:
    """Where each sequence's query rows and KV pages are: one step's metadata.

    cu_seqlens_q: [num_seqs + 1] int32, query row offsets
    seq_lens:     [num_seqs] int32, KV length of each sequence including its query tokens
    block_table:  [num_seqs, max_blocks] int32, physical block of each logical block
    max_query_len: host int >= every query length (picks the decode-only path when small)
    min_query_len: host int, the shortest query among sequences with any, if known (0 = unknown)
    max_seq_len:  host int, accepted for vLLM parity (unused: replays change sequence lengths)
    schedules:    where the balanced split's schedules of this batch are (workspace slots,
                  `balance.balanced_schedule`), written by its first call that needs one and
                  read by its later calls: build a PagedBatch per step, as vLLM builds its
                  metadata
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    min_query_len: int = 0
    max_seq_len: int = 0
    schedules: dict[tuple, tuple[torch.Tensor, int]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def lengths_version(self) -> tuple[int, int]:
        """The version counters of seq_lens and cu_seqlens_q (an in-place torch update bumps
        them), -1 for an inference tensor, which has none: vLLM runs its steps under
        `torch.inference_mode`, and tensors it creates there are such; a step there is a new
        PagedBatch anyway."""
        return (_version(self.seq_lens), _version(self.cu_seqlens_q))


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention options.

    scale:          softmax scale (> 0)
    sliding_window: None, or W keys per query (itself included), vLLM's convention
    softcap:        0 = off, else logits become softcap * tanh(logit / softcap)
    sinks:          [Hq] fp32 sink logits, or None
    k_scale, v_scale: [1] fp32 per-tensor scales, required for an fp8 cache
    """

    scale: float
    sliding_window: int | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def window(self) -> int:
        """The window as the kernels take it: 0 = off."""
        return 0 if self.sliding_window is None else self.sliding_window


BundledCall = Callable[..., torch.Tensor]


def flat_arguments(bundled: BundledCall, name: str) -> Callable[..., torch.Tensor]:
    """`name`, the flat keyword form of `bundled(q, key_cache, value_cache, out, batch, options,
    workspace)`: the public signature of the paged-attention entry points, in one place."""

    def call(
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
        batch = PagedBatch(
            cu_seqlens_q, seq_lens, block_table, max_query_len, min_query_len, max_seq_len
        )
        options = AttentionOptions(scale, sliding_window, softcap, sinks, k_scale, v_scale)
        return bundled(q, key_cache, value_cache, out, batch, options, workspace)

    functools.update_wrapper(call, bundled, assigned=("__module__", "__doc__"), updated=())
    call.__name__ = call.__qualname__ = name
    return call

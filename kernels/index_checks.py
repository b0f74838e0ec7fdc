"""Bounds checks on demand: the device-side indices of a call, checked before its launch.

The kernels trust the indices they read on the device (block-table entries, sequence lengths,
query offsets, KV slots, RoPE positions, sampling state slots): checking them needs the host
to wait for the GPU, which the serving path must not do. With checks on (`enable(True)`; the
plugin turns them on for `FUSELANE_CHECK_INDICES=1`, the tests always), every entry point
checks them first and raises a `ValueError` naming the tensor, the first bad position, its
value and the valid range, instead of reading or writing outside a tensor. Never inside a
CUDA-graph capture (no synchronisation is allowed there): a captured call is not checked.
Off, the entry points pay one flag test.
"""

from __future__ import annotations

import torch

_enabled = False


def enable(on: bool = True) -> None:
    """Turn the checks on or off for this process."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether this call should be checked (on, and not inside a CUDA-graph capture)."""
    return _enabled and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _first_bad(name: str, values: torch.Tensor, bad: torch.Tensor, expected: str) -> None:
    """Raise for the first True of `bad` (same shape as `values`), if any (one host sync)."""
    if not bool(bad.any()):
        return
    flat = bad.reshape(-1).nonzero()[0, 0]
    index = tuple(int(i) for i in torch.unravel_index(flat, bad.shape))
    where = index[0] if len(index) == 1 else index
    value = values.reshape(-1)[flat].item()
    raise ValueError(f"{name}[{where}]: expected {expected}, got {value}")


def check_paged_batch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Query offsets, sequence lengths and the block-table entries each sequence uses."""
    num_rows = q.shape[0]
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    cu = cu_seqlens_q.long()
    _first_bad("cu_seqlens_q", cu[:1], cu[:1] != 0, "0 at position 0")
    steps = cu[1:] - cu[:-1]
    _first_bad("cu_seqlens_q", cu[1:], steps < 0, "non-decreasing offsets")
    _first_bad("cu_seqlens_q", cu, cu > num_rows, f"offsets <= q.shape[0] = {num_rows}")
    lens = seq_lens.long()
    _first_bad("seq_lens", lens, lens < steps, "at least the sequence's query length")
    max_len = block_table.shape[1] * block_size
    _first_bad(
        "seq_lens",
        lens,
        lens > max_len,
        f"at most block_table.shape[1] * block_size = {max_len}",
    )
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < (
        (lens[:, None] + block_size - 1) // block_size
    )
    entries = block_table.long()
    _first_bad(
        "block_table",
        entries,
        used & ((entries < 0) | (entries >= num_blocks)),
        f"block ids in [0, {num_blocks}) for the blocks a sequence uses",
    )


def check_slots(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """KV slots: < 0 (padding) or a slot of the cache, each used once."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    _first_bad(
        "slot_mapping", slots, slots >= num_slots, f"< 0 (padding) or < {num_slots} cache slots"
    )
    valid = slots[slots >= 0]
    if valid.numel() != valid.unique().numel():
        sorted_slots = valid.sort().values
        dup = sorted_slots[1:][sorted_slots[1:] == sorted_slots[:-1]][0].item()
        raise ValueError(f"slot_mapping: expected distinct slots, got {dup} more than once")


def check_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """fp8 per-tensor scales: finite and > 0 (0 saturates every value to +-448, NaN stores NaN:
    the defined results without the checks, never what a caller meant)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            s = scale.float().reshape(-1)
            _first_bad(name, s, ~(s.isfinite() & (s > 0)), "a finite scale > 0")


def check_positions(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    rows = cos_sin_cache.shape[0]
    pos = positions.long()
    _first_bad("positions", pos, (pos < 0) | (pos >= rows), f"rows of cos_sin_cache in [0, {rows})")


def check_state_slots(state_slots: torch.Tensor, num_slots: int, what: str) -> None:
    slots = state_slots.long()
    _first_bad(
        "params.state_slots",
        slots,
        (slots < 0) | (slots >= num_slots),
        f"slots in [0, {num_slots}) ({what})",
    )


def check_token_ids(name: str, ids: torch.Tensor, live: torch.Tensor, vocab: int) -> None:
    t = ids.long()
    _first_bad(name, t, live & ((t < 0) | (t >= vocab)), f"token ids in [0, {vocab})")

"""The numerical checks of the KV write and of the fused RoPE + write: the cache rows at their
slots, and the rotated q and k, against the references."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fuselane.kernels.kv_cache import KVWrite, Rotary

from .numerics_base import (
    FP8,
    ROTARY_TOLERANCES,
    Outcome,
    Snapshot,
    _gather_rows,
    _spread,
    compare,
)

# --- KV-cache writes -------------------------------------------------------------------------


def _check_cache_rows(
    got: torch.Tensor,
    want: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor | None,
    what: str,
) -> Outcome | None:
    """Cache rows (bytes for fp8) vs the rows the reference writes: bit-exact."""
    from fuselane.kernels.kv_cache import quantize_e4m3_reference

    valid = slots >= 0
    if not bool(valid.any()):
        return None
    got, want = got[valid], want[valid]
    if scale is not None:  # fp8: compare the e4m3 values (exact), report dequantized errors
        want = quantize_e4m3_reference(want, scale).float() * scale.float()
        got = got.view(FP8).float() * scale.float()
    return compare(got, want, 0.0, 0.0, what)


class KVWriteSnapshot(Snapshot):
    kernel = "kv_cache"

    def check(self) -> Outcome | None:
        t = self.tensors
        k = _check_cache_rows(t["kc"], t["key"], t["slots"], t.get("k_scale"), "key cache rows")
        v = _check_cache_rows(t["vc"], t["value"], t["slots"], t.get("v_scale"), "value rows")
        if k is None or v is None:
            return None
        return k.merge(v)


class KVWriteCheck:
    """Snapshots of `fuselane.kernels.kv_cache.kv_write` calls."""

    before = None

    def after(self, pre: Any, result: Any, write: KVWrite) -> Snapshot | None:
        n = write.slot_mapping.shape[0]
        if n == 0:
            return None
        idx = _spread(n, write.key.device)
        slots = write.slot_mapping.index_select(0, idx).long()
        tensors = {
            "key": write.key.index_select(0, idx),
            "value": write.value.index_select(0, idx),
            **_written_rows(write, slots),
        }
        return KVWriteSnapshot(tensors)


def _written_rows(write: KVWrite, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The cache rows at `slots` (< 0: none) after the write, and an fp8 cache's scales."""
    rows = {
        "slots": slots,
        "kc": _gather_rows(write.key_cache, slots),
        "vc": _gather_rows(write.value_cache, slots),
    }
    if write.key_cache.dtype == FP8:
        rows["k_scale"] = write.k_scale.detach().float().reshape(1).clone()
        rows["v_scale"] = write.v_scale.detach().float().reshape(1).clone()
    return rows


class RopeKVWriteSnapshot(Snapshot):
    kernel = "rope_kv_cache"

    def check(self) -> Outcome | None:
        from fuselane.kernels.kv_cache import rotary_reference

        t, is_neox = self.tensors, self.info["is_neox"]
        positions = torch.arange(t["q_in"].shape[0])  # rows of the gathered cos/sin table
        q_ref = rotary_reference(positions, t["q_in"], t["cos_sin"], is_neox)
        k_ref = rotary_reference(positions, t["k_in"], t["cos_sin"], is_neox)
        atol, rtol = ROTARY_TOLERANCES.get(q_ref.dtype, (1.6e-2, 1.6e-2))
        out = compare(t["q_out"], q_ref, atol, rtol, "rotated query")
        out = out.merge(compare(t["k_out"], k_ref, atol, rtol, "rotated key"))
        # The cache holds the key as written back (the kernel's contract), bit for bit.
        for got, want, scale, what in (
            (t["kc"], t["k_out"], t.get("k_scale"), "key cache rows"),
            (t["vc"], t["v_in"], t.get("v_scale"), "value cache rows"),
        ):
            rows = _check_cache_rows(got, want, t["slots"], scale, what)
            if rows is not None:
                out = out.merge(rows)
        return out


class RopeKVWriteCheck:
    """Snapshots of `fuselane.kernels.kv_cache.rope_kv_write` calls (in place: the
    inputs are kept before the launch)."""

    def before(self, rotary: Rotary, write: KVWrite) -> dict[str, torch.Tensor] | None:
        positions, query, cos_sin_cache = rotary.positions, rotary.query, rotary.cos_sin_cache
        key = write.key
        num_rows = query.shape[0]
        if num_rows == 0:
            return None
        idx = _spread(num_rows, query.device)
        pos = positions.index_select(0, idx).long().clamp(0, cos_sin_cache.shape[0] - 1)
        return {
            "idx": idx,
            "q_in": query.index_select(0, idx),
            "k_in": key.index_select(0, idx),
            "cos_sin": cos_sin_cache.index_select(0, pos),
        }

    def after(
        self, pre: dict[str, torch.Tensor] | None, result: Any, rotary: Rotary, write: KVWrite
    ) -> Snapshot | None:
        if pre is None:
            return None
        idx = pre.pop("idx")
        slot_mapping = write.slot_mapping
        n = slot_mapping.shape[0]
        if n > 0:  # rows past len(slot_mapping) are rotated but not written
            written = slot_mapping.index_select(0, idx.clamp(max=n - 1)).long()
            slots = torch.where(idx < n, written, -1)
        else:
            slots = torch.full_like(idx, -1)
        tensors = dict(
            pre,
            q_out=rotary.query.index_select(0, idx),
            k_out=write.key.index_select(0, idx),
            v_in=write.value.index_select(0, idx),
            **_written_rows(write, slots),
        )
        return RopeKVWriteSnapshot(tensors, is_neox=bool(rotary.is_neox))

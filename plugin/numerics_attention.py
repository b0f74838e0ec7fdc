"""The numerical check of paged attention: one sequence's last query rows against
`attention_reference`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fuselane.kernels.attention import AttentionOptions, PagedBatch

from .numerics_base import (
    ATTENTION_TOLERANCES,
    FP8,
    MAX_ROWS,
    MAX_SNAPSHOT_BYTES,
    Outcome,
    Snapshot,
    SnapshotTooLarge,
    _Rotating,
    _tensor_bytes,
    compare,
)

# --- attention -------------------------------------------------------------------------------


class AttentionSnapshot(Snapshot):
    kernel = "attention"

    def check(self) -> Outcome | None:
        # Imported here: the plugin loads the kernels only where a check runs.
        from fuselane.kernels.attention import AttentionOptions, PagedBatch, attention_reference

        t, info = self.tensors, self.info
        cu0, cu1, seq_len = (int(v) for v in t["meta"].tolist())
        rows = info["rows"]
        r = min(rows, cu1 - cu0)
        k, v = t["k"], t["v"]
        if info["fp8"]:
            k, v = k.view(FP8), v.view(FP8)
        num_pages, block_size = k.shape[0], k.shape[1]
        if r <= 0 or seq_len <= 0 or -(-seq_len // block_size) > num_pages:
            return None  # nothing of this sequence in the step, or pages beyond the bound
        q = t["q"][rows - r :]
        out = t["out"][rows - r :]
        ref = torch.zeros(q.shape, dtype=torch.float32)
        batch = PagedBatch(
            torch.tensor([0, r], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32),
            torch.arange(num_pages, dtype=torch.int32)[None],
            max_query_len=r,
            max_seq_len=seq_len,
        )
        options = AttentionOptions(
            scale=info["scale"],
            sliding_window=info["sliding_window"],
            softcap=info["softcap"],
            sinks=t.get("sinks"),
            k_scale=t.get("k_scale"),
            v_scale=t.get("v_scale"),
        )
        attention_reference(q, k, v, ref, batch, options)
        atol, rtol = ATTENTION_TOLERANCES.get(q.dtype, (2.5e-2, 2.5e-2))
        return compare(out, ref, atol, rtol, "attention output")


class AttentionCheck:
    """Snapshots of `fuselane.kernels.attention.attention` calls (the bundled form the backend
    makes)."""

    before = None

    def __init__(self) -> None:
        self._pick = _Rotating()

    def after(
        self,
        pre: Any,
        result: Any,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        batch: PagedBatch,
        options: AttentionOptions,
        workspace: Any = None,
    ) -> Snapshot | None:
        cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
        max_query_len, max_seq_len = batch.max_query_len, batch.max_seq_len
        num_seqs, num_rows = seq_lens.shape[0], q.shape[0]
        if num_seqs == 0 or num_rows == 0:
            return None
        b = self._pick.next(num_seqs)
        rows = max(1, min(int(max_query_len), MAX_ROWS, num_rows))
        block_size = key_cache.shape[1]
        pages = min(block_table.shape[1], -(-int(max_seq_len) // block_size))
        nbytes = 2 * pages * _tensor_bytes(key_cache, 1) + 2 * _tensor_bytes(q, rows)
        if nbytes > MAX_SNAPSHOT_BYTES:
            raise SnapshotTooLarge(f"attention: {nbytes} bytes")
        dev = q.device
        # The last `rows` query rows of sequence b (rows of its neighbour when it has fewer:
        # the check drops those, knowing the real length from `meta`).
        end = cu_seqlens_q[b + 1].long()
        row_idx = (end - rows + torch.arange(rows, device=dev)).clamp(0, num_rows - 1)
        table = block_table[b, :pages].long().clamp(0, key_cache.shape[0] - 1)
        fp8 = key_cache.dtype == FP8
        kc = key_cache.view(torch.uint8) if fp8 else key_cache
        vc = value_cache.view(torch.uint8) if fp8 else value_cache
        tensors = {
            "q": q.index_select(0, row_idx),
            "out": out.index_select(0, row_idx),
            "k": kc.index_select(0, table),
            "v": vc.index_select(0, table),
            "meta": torch.stack(
                [cu_seqlens_q[b].long(), cu_seqlens_q[b + 1].long(), seq_lens[b].long()]
            ),
        }
        if options.sinks is not None:
            tensors["sinks"] = options.sinks.detach().float().clone()
        if fp8:
            tensors["k_scale"] = options.k_scale.detach().float().reshape(1).clone()
            tensors["v_scale"] = options.v_scale.detach().float().reshape(1).clone()
        return AttentionSnapshot(
            tensors,
            rows=rows,
            fp8=fp8,
            scale=float(options.scale),
            sliding_window=options.sliding_window,
            softcap=float(options.softcap),
        )

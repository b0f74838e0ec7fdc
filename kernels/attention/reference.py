"""The torch reference that defines paged attention's semantics (fp32, one sequence at a time)."""

from __future__ import annotations

import torch

from .._checks import FP8_E4M3
from .args import AttentionOptions, PagedBatch, flat_arguments


def attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: object = None,
) -> torch.Tensor:
    """fp32 torch definition of `ops.attention` (same arguments; a workspace is ignored).

    Gathers each sequence's pages, dequantizes fp8 (value = stored * scale), and computes
    softmax(mask(softcap(scale * q k^T)) [+ sink column]) v per query head in fp32. Reads the
    lengths on the host: a reference, not for the serving path.
    """
    del workspace  # the reference needs no scratch, and no length hints from the batch
    scale, softcap, sliding_window = options.scale, options.softcap, options.sliding_window
    num_q_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    kv_fp8 = key_cache.dtype == FP8_E4M3
    cu = batch.cu_seqlens_q.tolist()
    lens = batch.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, stop = cu[b], cu[b + 1]
        q_len = stop - start
        if q_len <= 0:
            continue
        pages = batch.block_table[b, : (seq_len + block_size - 1) // block_size].long()
        k = key_cache[pages].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        v = value_cache[pages].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        if kv_fp8:
            k = k * options.k_scale.float().reshape(())
            v = v * options.v_scale.float().reshape(())
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
        if options.sinks is not None:
            sink_col = options.sinks.float()[:, None, None].expand(num_q_heads, q_len, 1)
            s = torch.cat([s, sink_col], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :seq_len]
        out[start:stop] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)
    return out


paged_attention_reference = flat_arguments(attention_reference, "paged_attention_reference")

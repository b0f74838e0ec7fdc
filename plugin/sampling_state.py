"""vLLM V1's per-request sampling state as the fused sampler's tensors.

V1 keeps prompt token ids as a padded tensor and output token ids as Python lists, and its
logit-bias processor keeps a dict per request; the fused kernel reads packed prompt / output
bit masks, output counts, and padded bias lists. These build them (plain torch, on the device
of the inputs). V2 keeps the kernel's form itself, so its path needs none of this.
"""

from __future__ import annotations

import torch

from fuselane.kernels.sampling import pack_bin_mask


def penalty_state_from_v1(
    prompt_token_ids: torch.Tensor,
    output_token_ids: list[list[int]] | torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM V1's penalty inputs -> (prompt_bin_mask, output_bin_counts, output_bin_mask).

    prompt_token_ids: [B, Lp] int64 padded with `vocab` (V1 SamplingMetadata); output_token_ids:
    V1's per-row lists, or a [B, Lo] tensor padded with `vocab` or -1. Rows map to slots 1:1
    (leave `state_slots` None). Runs on prompt_token_ids' device; list input costs one copy.
    """
    dev = prompt_token_ids.device
    B = prompt_token_ids.shape[0]
    if not isinstance(output_token_ids, torch.Tensor):
        width = max((len(o) for o in output_token_ids), default=0)
        out = torch.full((B, max(1, width)), vocab, dtype=torch.int64)
        for i, o in enumerate(output_token_ids):
            if o:
                out[i, : len(o)] = torch.tensor(o, dtype=torch.int64)
        output_token_ids = out.to(dev)
    out = output_token_ids.to(torch.int64).masked_fill(output_token_ids < 0, vocab)
    counts = torch.zeros(B, vocab + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    counts = counts[:, :vocab].contiguous()
    prompt = torch.zeros(B, vocab + 1, dtype=torch.bool, device=dev)
    prompt.scatter_(1, prompt_token_ids.to(torch.int64), True)
    return pack_bin_mask(prompt[:, :vocab]), counts, pack_bin_mask(counts > 0)


def logit_bias_from_dicts(
    biases: dict[int, dict[int, float]], num_rows: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM V1's LogitBiasLogitsProcessor state {row: {token: bias}} -> (counts [B] int32,
    token_ids [B, NB] int32, values [B, NB] fp32), rows mapping to slots 1:1."""
    width = max((len(d) for d in biases.values()), default=0)
    width = max(1, width)
    counts = torch.zeros(num_rows, dtype=torch.int32)
    toks = torch.zeros(num_rows, width, dtype=torch.int32)
    vals = torch.zeros(num_rows, width, dtype=torch.float32)
    for r, d in biases.items():
        counts[r] = len(d)
        toks[r, : len(d)] = torch.tensor(list(d.keys()), dtype=torch.int32)
        vals[r, : len(d)] = torch.tensor(list(d.values()), dtype=torch.float32)
    return counts.to(device), toks.to(device), vals.to(device)

"""Statistics the sampling checks use (the kernel tests and the GPU benchmark)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of `counts` [K] against `probs` [K]
    (categories with zero probability must have zero counts, else p = 0)."""
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    n = counts.sum()
    live = probs > 0
    if (counts[~live] > 0).any():
        return 0.0
    exp = probs[live] / probs[live].sum() * n
    stat = ((counts[live] - exp) ** 2 / exp).sum()
    dof = int(live.sum()) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))

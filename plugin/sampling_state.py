"""vLLM V1's per-request sampling state as the fused sampler's tensors.

V1 keeps prompt token ids as a padded tensor and output token ids as Python lists, and its
logit-bias processor keeps a dict per request; the fused kernel reads packed prompt / output
bit masks, output counts, and padded bias lists. These build them (plain torch, on the device
of the inputs). V2 keeps the kernel's form itself, so its path needs none of this.
"""

from __future__ import annotations

import numpy as np
import torch

from fuselane.kernels.sampling import pack_bin_mask


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor built for this step onto `device` without waiting for the GPU: a copy from
    pageable memory synchronizes the stream first, which would stall vLLM's asynchronous
    scheduling (the host preparing the next step while this one runs) on every sampler call.
    Pinned memory is what vLLM's own sampler copies from."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def prompt_bin_mask_from_v1(prompt_token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """V1's prompt token ids ([B, Lp] int64 padded with `vocab`, on the device) -> the packed
    prompt bit mask [B, ceil(vocab / 32)] int32. V1 keeps the same tensor while the batch is
    unchanged, so callers can keep the mask as long as they get the same tensor."""
    B = prompt_token_ids.shape[0]
    prompt = torch.zeros(B, vocab + 1, dtype=torch.bool, device=prompt_token_ids.device)
    prompt.scatter_(1, prompt_token_ids.to(torch.int64), True)
    return pack_bin_mask(prompt[:, :vocab])


def output_state_from_v1(
    output_token_ids: list[list[int]] | torch.Tensor,
    vocab: int,
    device: torch.device | str,
    *,
    with_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V1's output token ids (per-row lists, or a [B, Lo] tensor padded with `vocab` or -1;
    -1 also marks async scheduling's placeholders) -> (output_bin_counts [B, vocab] int32,
    packed output_bin_mask) on `device`. The lists are padded in numpy (a torch tensor per row
    cost ~4x as much at 256 rows of 512 ids) and copied without a stream sync (`to_device`).
    `with_mask=False` leaves the mask out (None), the sampler's per-step form: on an H100
    packing the mask took 1.05 ms of GPU time at 256 rows over 151,936 tokens while the kernel
    read the counts densely about as fast as through it (0.29-0.30 against 0.28-0.40 ms;
    `v1-penalty-state-h100-2026-11-27{,-run2}.json`)."""
    if not isinstance(output_token_ids, torch.Tensor):
        width = max(1, max(map(len, output_token_ids), default=0))
        ids = np.full((len(output_token_ids), width), vocab, dtype=np.int64)
        for i, row in enumerate(output_token_ids):
            if row:
                ids[i, : len(row)] = row
        output_token_ids = to_device(torch.from_numpy(ids), device)
    ids = output_token_ids.to(torch.int64)
    real = (ids >= 0) & (ids < vocab)  # padding and placeholders add 0 (to token 0)
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int32, device=ids.device)
    # Into [B, vocab] itself: a padding column sliced off would leave a one-row batch with row
    # stride vocab + 1 (a [1, vocab] slice is already contiguous), another kernel variant.
    counts.scatter_add_(1, ids.where(real, 0), real.to(torch.int32))
    return counts, pack_bin_mask(counts > 0) if with_mask else None


class OutputCounts:
    """V1's output-token counts [rows, vocab] int32 kept on the device across sampler steps.
    Not used by the sampler yet: its one GPU timing was of an earlier form (index_put_, 22 ms a
    step, `v1-penalty-state-h100-2026-11-27-run2.json`); the sampler takes it once this form is
    timed below the rebuild's 3.8-4.1 ms.

    V1 passes each row's output ids as the request's own list, appended to in place (one id a
    step, or placeholders -1 that async scheduling fills in later), and moves a list to another
    row only when the batch changes. Building the counts from all the lists every step costs
    host time linear in every id ever generated (3.8 ms at 256 rows of 300 ids,
    `v1-penalty-state-h100-2026-11-27.json`); here a step adds only each row's ids finalized
    since the last one (the prefix before its trailing placeholders) and rebuilds a row whose
    list changed: another list object, fewer finalized ids, or another last counted id (vLLM
    drops output ids after a KV-load failure)."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None
        # per row: (its list, ids counted, the last one counted); the list is held so that its
        # identity is not reused by another while it is compared
        self._rows: list[tuple[list[int] | None, int, int]] = []

    def update(self, lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
        """The counts of `lists` (one per row, V1's form) as a [len(lists), vocab] view."""
        B = len(lists)
        c = self._counts
        if c is None or c.shape[0] < B or c.shape[1] != vocab or c.device != torch.device(device):
            rows = max(B, 0 if c is None or c.shape[1] != vocab else c.shape[0])
            c = self._counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
            self._rows = []
        self._rows += [(None, 0, 0)] * (c.shape[0] - len(self._rows))
        rebuild: list[int] = []
        at: list[int] = []
        ids: list[int] = []
        for i, row in enumerate(lists):
            row = row if row is not None else []
            n = len(row)
            while n and row[n - 1] < 0:  # async scheduling's placeholders, filled in later
                n -= 1
            held, counted, last = self._rows[i]
            if held is row and counted <= n and (not counted or row[counted - 1] == last):
                start = counted
            else:
                rebuild.append(i)
                start = 0
            if n > start:
                at += [i] * (n - start)
                ids += row[start:n]
            self._rows[i] = (row, n, row[n - 1] if n else 0)
        if rebuild:
            c.index_fill_(0, to_device(torch.tensor(rebuild, dtype=torch.int64), device), 0)
        if ids:
            where = to_device(torch.tensor([at, ids], dtype=torch.int64), device)
            token = where[1]
            real = (token >= 0) & (token < vocab)  # anything else adds 0 (to token 0)
            # index_add_ on the flat view: one atomic add per id. index_put_(accumulate=True)
            # took 22 ms a step at 256 x 151,936 on an H100 (its sorting path).
            flat = where[0] * vocab + token.where(real, 0)
            c.view(-1).index_add_(0, flat, real.to(torch.int32))
        return c[:B]


def penalty_state_from_v1(
    prompt_token_ids: torch.Tensor,
    output_token_ids: list[list[int]] | torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V1's penalty inputs -> (prompt_bin_mask, output_bin_counts, output_bin_mask), rows
    mapping to slots 1:1 (leave `state_slots` None), on prompt_token_ids' device."""
    counts, mask = output_state_from_v1(output_token_ids, vocab, prompt_token_ids.device)
    return prompt_bin_mask_from_v1(prompt_token_ids, vocab), counts, mask


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
    return to_device(counts, device), to_device(toks, device), to_device(vals, device)

"""The numerical check of fused sampling: one row's kept set, chosen token and log-probability
against the reference."""

from __future__ import annotations

import math
from typing import Any

import torch

from .numerics_base import (
    LOGPROB_TOLERANCE,
    Outcome,
    Snapshot,
    _Rotating,
    compare,
)

# --- sampling --------------------------------------------------------------------------------

# SamplingParamsTensors fields: per batch row, and per request-state slot.
_ROW_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seeds",
    "has_seed",
    "seed_offsets",
)
_SLOT_FIELDS = (
    "prompt_bin_mask",
    "output_bin_counts",
    "output_bin_mask",
    "logit_bias_counts",
    "logit_bias_token_ids",
    "logit_bias_values",
)


class SamplingSnapshot(Snapshot):
    kernel = "sampling"

    def check(self) -> Outcome | None:
        from fuselane.kernels import sampling as S

        t, info = self.tensors, self.info
        params = S.SamplingParamsTensors(
            **{f: t[f] for f in (*_ROW_FIELDS, *_SLOT_FIELDS) if f in t}
        )
        x = t["logits"].to(torch.float32)
        x = torch.where(torch.isnan(x), float("-inf"), x)  # the kernel's NaN policy
        y = S.apply_penalties_reference(S.apply_bias_reference(x, params), params)
        z_pre, greedy_rows = S.apply_temperature_reference(y, params.temperature)
        z = S.top_k_top_p_reference(
            S.apply_min_p_reference(z_pre, params.min_p), params.top_k, params.top_p
        )
        kept = z[0] > float("-inf")
        tok = int(t["token"][0])
        greedy = bool(greedy_rows[0])
        problems = []
        mismatched = 0
        if not 0 <= tok < x.shape[1]:
            problems.append(f"token id {tok} outside the vocabulary")
            mismatched += 1
        elif greedy:
            if bool(torch.isfinite(y[0]).any()) and not bool(y[0, tok] == y[0].max()):
                problems.append(f"greedy row chose {tok}, not an argmax")
                mismatched += 1
        elif not bool(kept[tok]):
            problems.append(f"chose {tok}, outside the reference's kept set")
            mismatched += 1
        if not greedy and "kept_count" in t:
            ref_kept = int(kept.sum())
            diff = abs(int(t["kept_count"][0]) - ref_kept)
            if diff > max(1, math.ceil(0.01 * ref_kept)):
                problems.append(f"kept {int(t['kept_count'][0])} tokens, reference {ref_kept}")
                mismatched += diff
        out = Outcome(not problems, mismatched=mismatched, detail="; ".join(problems))
        if "logprob" in t and 0 <= tok < x.shape[1]:
            mode = info["logprobs_mode"]
            values = {
                "raw_logprobs": lambda: x.log_softmax(-1),
                "raw_logits": lambda: x,
                "processed_logits": lambda: z,
                "processed_logprobs": lambda: z.double().log_softmax(-1).float(),
            }[mode]()
            atol, rtol = LOGPROB_TOLERANCE
            out = out.merge(
                compare(t["logprob"], values[0, tok].reshape(1), atol, rtol, "chosen logprob")
            )
        return out


class SamplingCheck:
    """Snapshots of `fuselane.kernels.sampling.fused_sample` calls (one row per check). With
    `logits_writable` the kernel may write penalized values into the logits, so the row is
    kept before the launch."""

    def __init__(self) -> None:
        self._pick = _Rotating()

    def before(
        self, logits: torch.Tensor, params: Any, **kwargs: Any
    ) -> tuple[int, torch.Tensor] | None:
        num_rows = logits.shape[0]
        if num_rows == 0:
            return None
        b = self._pick.next(num_rows)
        return b, logits[b : b + 1].clone()

    def after(
        self,
        pre: tuple[int, torch.Tensor] | None,
        out: Any,
        logits: torch.Tensor,
        params: Any,
        *,
        workspace: Any = None,
        num_logprobs: int | None = 0,
        logprobs_mode: str = "raw_logprobs",
        logits_writable: bool = False,
    ) -> Snapshot | None:
        if pre is None:
            return None
        b, row = pre
        tensors = {"logits": row, "token": out.token_ids[b : b + 1].clone()}
        for name in _ROW_FIELDS:
            value = getattr(params, name)
            if value is not None:
                tensors[name] = value[b : b + 1].clone()
        slot = (
            params.state_slots[b : b + 1].long()
            if params.state_slots is not None
            else torch.full((1,), b, dtype=torch.long, device=logits.device)
        )
        for name in _SLOT_FIELDS:
            value = getattr(params, name)
            if value is not None:
                tensors[name] = value.index_select(0, slot)
        if num_logprobs is not None and out.logprob is not None:
            tensors["logprob"] = out.logprob[b : b + 1].clone()
        if out.kept_count is not None:
            tensors["kept_count"] = out.kept_count[b : b + 1].clone()
        return SamplingSnapshot(tensors, logprobs_mode=logprobs_mode)

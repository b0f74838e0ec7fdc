"""The fused sampler's argument bundles: per-row parameters in, outputs out."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParamsTensors:
    """Per-row sampling parameters as device tensors; None turns a step off for the whole batch.

    Per row ([B]): temperature fp32 (< 1e-5 = greedy; None = 1.0 for every row), top_k int32/64
    (<= 0 or >= V = off), top_p fp32 (>= 1 = off), min_p fp32 (0 = off), repetition_penalty /
    frequency_penalty / presence_penalty fp32 (1 / 0 / 0 = off; None = off), seeds int64,
    has_seed bool (None with seeds given: every row is seeded), seed_offsets int64 (the position
    the draw is for: vLLM V2 passes the token position; None = 0).

    Per request slot (vLLM V2's layout; `state_slots [B]` int32/64 maps a row to its slot,
    None = row b uses slot b): prompt_bin_mask [S, ceil(V/32)] int32 (bit t%32 of word t/32 set
    when token t is in the prompt), output_bin_counts [S, V] int32, output_bin_mask
    [S, ceil(V/32)] int32 (optional: presence bits of the output tokens; when given, counts are
    read only where a bit is set, which saves a dense read of the counts), logit_bias_counts [S]
    int32 with logit_bias_token_ids [S, NB] int32 and logit_bias_values [S, NB] fp32 (the first
    count entries of the slot's lists; any order). `penalty_state_from_v1` and
    `logit_bias_from_dicts` build these from vLLM V1's forms.
    """

    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    prompt_bin_mask: torch.Tensor | None = None
    output_bin_counts: torch.Tensor | None = None
    output_bin_mask: torch.Tensor | None = None
    logit_bias_counts: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    has_seed: torch.Tensor | None = None
    seed_offsets: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return any(
            t is not None
            for t in (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        )

    @property
    def has_bias(self) -> bool:
        return self.logit_bias_counts is not None


@dataclass
class SampleOutput:
    """token_ids [B] int64; logprob [B] fp32 (None when logprobs were not asked for);
    topn_ids [B, n] int64 (-1 = padding) and topn_logprobs [B, n] fp32 (None when n = 0);
    nan_rows [B] int32 (NaN logits per row). Diagnostics: kept_count [B] int32 (tokens that
    survived min-p/top-k/top-p), kept_threshold [B] fp32 (kept = finite processed values >=
    it), fallback_rows [B] int32 (kernel only: 1 = exact row-pass fallback for the draw,
    2 = for top-n)."""

    token_ids: torch.Tensor
    logprob: torch.Tensor | None
    topn_ids: torch.Tensor | None
    topn_logprobs: torch.Tensor | None
    nan_rows: torch.Tensor
    kept_count: torch.Tensor | None = None
    kept_threshold: torch.Tensor | None = None
    fallback_rows: torch.Tensor | None = None

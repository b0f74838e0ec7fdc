"""fuselane's V1 sampler (plugin/sampler_v1.py, `make_v1_sampler`) called directly on vLLM's
own V1 `Sampler` class and `SamplingMetadata` (no engine): rows with NaN logits stay on the
fused path, without a host sync, and never draw a NaN token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from fuselane.plugin import sampler_common, sampler_hook


def _metadata(temperature: list[float], top_k: list[int]) -> SamplingMetadata:
    b = len(temperature)
    return SamplingMetadata(
        temperature=torch.tensor(temperature),
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        top_p=None,
        top_k=torch.tensor(top_k),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(b),
        presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b),
        output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        logprob_token_ids=None,
        spec_token_ids=None,
        thinking_budget_state_holder=None,
    )


def test_nan_rows_stay_fused_and_never_draw_a_nan_token():
    vocab = 64
    sampler = sampler_hook.make_v1_sampler(Sampler)(logprobs_mode="raw_logprobs")
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    clean = logits.clone()
    nan_ids = [int(logits[1].argmax()), 5, 7]
    logits[1, nan_ids] = float("nan")
    sampler_hook.reset_counters()
    for _ in range(8):  # several draws of the random NaN row
        out = sampler.forward(logits, _metadata([0.0, 0.7, 0.7], [vocab, 10, vocab]))
        tokens = out.sampled_token_ids.flatten().tolist()
        assert tokens[0] == int(clean[0].argmax())  # the greedy row
        assert tokens[1] not in nan_ids
        assert 0 <= tokens[2] < vocab
    assert sampler_hook.counters() == {"fused": 8}
    assert sampler._fuselane_ws.arith == "triton"  # the fast rounding (see V1_ARITH)


def test_a_kernel_failing_its_warm_up_sends_every_batch_to_vllms_sampler(monkeypatch):
    """Start-up: a sampling kernel that cannot compile or launch switches fused sampling off for
    the process (logged), and that first batch and every later one get vLLM's own result."""
    from fuselane.plugin import warmup

    def fails(kind, key, device, compile_all):
        raise RuntimeError("PTX .version 9.4 does not support .target sm_90a")

    monkeypatch.setattr(warmup, "once", fails)
    monkeypatch.setattr(sampler_common, "_fused_off", None)
    vocab = 64
    sampler = sampler_hook.make_v1_sampler(Sampler)(logprobs_mode="raw_logprobs")
    stock = Sampler(logprobs_mode="raw_logprobs")
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    md = _metadata([0.0, 0.0, 0.0], [vocab, vocab, vocab])
    sampler_hook.reset_counters()
    for _ in range(2):
        got = sampler.forward(logits.clone(), md).sampled_token_ids
        assert torch.equal(got, stock.forward(logits.clone(), md).sampled_token_ids)
    assert "RuntimeError at start-up: PTX" in sampler_hook.fused_sampling_off()
    assert sampler_hook.counters() == {"stock": 2, "stock:startup": 2}


def _penalized(md: SamplingMetadata, prompts: torch.Tensor, outputs: list[list[int]]):
    md.no_penalties = False
    md.prompt_token_ids = prompts
    md.output_token_ids = outputs
    md.repetition_penalties = torch.tensor([2.0, 1.0, 1.5])
    md.frequency_penalties = torch.tensor([0.0, 1.5, 0.5])
    md.presence_penalties = torch.tensor([0.0, 0.0, 1.0])
    return md


def test_penalties_from_v1s_lists_match_vllms_sampler():
    """Penalties from V1's per-row output lists (padded in numpy, -1 for async scheduling's
    placeholders) and its padded prompt ids: the fused greedy pick equals vLLM's own, which
    applies the same penalties first; the penalties move every row's pick here."""
    vocab = 64
    sampler = sampler_hook.make_v1_sampler(Sampler)(logprobs_mode="raw_logprobs")
    stock = Sampler(logprobs_mode="raw_logprobs")
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) + 1.0
    top = logits.argmax(-1).tolist()
    prompts = torch.tensor([[top[0], 3, vocab], [4, vocab, vocab], [top[2], 9, 10]])
    outputs = [[5], [top[1], top[1], -1], [top[2], 11, -1]]
    md = _penalized(_metadata([0.0, 0.0, 0.0], [vocab] * 3), prompts, outputs)
    sampler_hook.reset_counters()
    got = sampler.forward(logits.clone(), md).sampled_token_ids.flatten().tolist()
    want = stock.forward(logits.clone(), md).sampled_token_ids.flatten().tolist()
    assert got == want and all(g != t for g, t in zip(got, top, strict=True))
    assert sampler_hook.counters() == {"fused": 1}


def test_prompt_mask_is_kept_while_v1_keeps_its_prompt_tensor():
    vocab = 64
    sampler = sampler_hook.make_v1_sampler(Sampler)(logprobs_mode="raw_logprobs")
    prompts = torch.tensor([[1, 2, vocab], [3, vocab, vocab]])
    first = sampler._prompt_mask(prompts, 2, vocab)
    assert sampler._prompt_mask(prompts, 2, vocab) is first
    changed = prompts.clone()
    changed[1, 0] = 40  # a new batch: V1 builds a new tensor
    again = sampler._prompt_mask(changed, 2, vocab)
    assert again is not first and not torch.equal(again, first)
    from fuselane.plugin import sampling_state

    assert torch.equal(again, sampling_state.prompt_bin_mask_from_v1(changed, vocab))


def test_output_state_from_lists_equals_the_padded_tensor_form():
    from fuselane.plugin import sampling_state

    vocab = 50
    lists = [[], [3, 3, 49, -1], [0]]
    padded = torch.tensor([[vocab] * 4, [3, 3, 49, -1], [0, -1, -1, -1]])
    a_counts, a_mask = sampling_state.output_state_from_v1(lists, vocab, "cpu")
    b_counts, b_mask = sampling_state.output_state_from_v1(padded, vocab, "cpu")
    assert torch.equal(a_counts, b_counts) and torch.equal(a_mask, b_mask)
    assert a_counts[1, 3] == 2 and a_counts[1, 49] == 1 and a_counts.sum() == 4

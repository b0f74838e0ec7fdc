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

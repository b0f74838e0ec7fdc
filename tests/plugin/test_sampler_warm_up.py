"""The sampler hooks' start-up compile list: the variants a serving run meets, logprobs included."""

from __future__ import annotations

import torch

from fuselane.kernels import sampling
from fuselane.plugin import sampler_hook, warmup


def _warmed(monkeypatch, n: int | None) -> list[tuple[tuple, int | None, str]]:
    calls: list[tuple[tuple, int | None, str]] = []

    def spy(template, ws, dtype, *, param_sets, num_logprobs, logprobs_mode="raw_logprobs"):
        calls.extend((s, num_logprobs, logprobs_mode) for s in param_sets)
        return len(param_sets)

    # warmup.once compiles only on CUDA devices; here it runs the list it is given
    monkeypatch.setattr(warmup, "once", lambda kind, key, device, fn: fn() > 0)
    monkeypatch.setattr(sampling, "warm_up", spy)
    logits = torch.zeros(2, 64)
    ws = sampling.SamplingWorkspace.allocate(2, 64, logits.device, max_logprobs=2)
    assert sampler_hook._warm_up(
        "v1", logits, sampling.SamplingParamsTensors(), ws, n, "raw_logprobs",
        sampler_hook.V1_WARM_PARAM_SETS,
    )  # fmt: skip
    return calls


def test_warm_up_covers_requests_asking_logprobs(monkeypatch):
    calls = _warmed(monkeypatch, None)
    plain = [(s, n) for s, n, _ in calls if n is None]
    assert [s for s, _ in plain] == list(sampler_hook.V1_WARM_PARAM_SETS)
    for extra in (0, 1, 9):  # 0: the chosen token's; 1 / 9: the two narrow top-n widths
        assert [s for s, n, _ in calls if n == extra] == list(sampler_hook.WARM_LOGPROB_PARAM_SETS)
    assert {m for _, _, m in calls} == {"raw_logprobs"}
    # every logprob set is one the plain list warms too (same parameters, other variant)
    assert set(sampler_hook.WARM_LOGPROB_PARAM_SETS) <= set(sampler_hook.V1_WARM_PARAM_SETS)


def test_warm_up_does_not_repeat_the_first_calls_logprobs(monkeypatch):
    calls = _warmed(monkeypatch, 1)
    assert sorted({n for _, n, _ in calls}) == [0, 1, 9]
    assert sum(1 for _, n, _ in calls if n == 1) == len(sampler_hook.V1_WARM_PARAM_SETS)

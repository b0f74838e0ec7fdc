"""The sampler hooks' start-up compile list: the variants a serving run meets, logprobs included."""

from __future__ import annotations

import pytest
import torch

from fuselane.kernels import sampling
from fuselane.plugin import sampler_hook, warmup


def _warmed(monkeypatch, n: int | None) -> list[tuple[tuple, int | None, str]]:
    calls: list[tuple[tuple, int | None, str]] = []

    def spy(
        template, ws, dtype, *, param_sets, num_logprobs, logprobs_mode="raw_logprobs",
        logits_writable=False,
    ):  # fmt: skip
        # as run_fused calls the kernel: logits writable exactly when no logprobs are asked
        assert logits_writable == (num_logprobs is None)
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


# ----------------------------------------------------------------------------------------------
# Penalized batches: the warm-up launches the variants a penalized request meets
# ----------------------------------------------------------------------------------------------


def _variant(fn, args, kwargs) -> tuple:
    """What Triton compiles a launch of `fn` for: each tensor's dtype and 16-byte alignment,
    each integer's ==1 and %16 (its specializations), the constexprs and launch options."""

    def spec(a):
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, bool) or not isinstance(a, int):
            return a
        return ("int", a == 1, a % 16 == 0)

    return (fn.__name__, tuple(spec(a) for a in args), tuple(sorted(kwargs.items())))


def _launched(monkeypatch, call, *args, **kwargs) -> set[tuple]:
    """The variants `call(*args, **kwargs)` launches."""
    seen: set[tuple] = set()
    # recorded, not run: only which variants are launched matters here
    monkeypatch.setattr(
        sampling.ops, "launch", lambda fn, grid, *a, **kw: seen.add(_variant(fn, a, kw))
    )
    call(*args, **kwargs)
    monkeypatch.undo()
    return seen


def _penalized_params(B: int, V: int, runner: str) -> sampling.SamplingParamsTensors:
    """A batch of B rows with temperature / top-k / top-p and penalties, its penalty state in
    the runner's form: V1's per-row state, V2's per-slot state read through state_slots."""
    from fuselane.plugin import sampling_state

    g = torch.Generator().manual_seed(B)
    p = sampling.SamplingParamsTensors(
        temperature=torch.full((B,), 0.8), top_k=torch.full((B,), 50, dtype=torch.int32),
        top_p=torch.full((B,), 0.95), repetition_penalty=torch.full((B,), 1.1),
        frequency_penalty=torch.zeros(B), presence_penalty=torch.zeros(B),
    )  # fmt: skip
    prompt = torch.randint(0, V, (B, 7), generator=g)
    outputs = [torch.randint(0, V, (i + 1,), generator=g).tolist() for i in range(B)]
    if runner == "v1":  # as the V1 sampler builds it: output counts without presence bits
        p.prompt_bin_mask = sampling_state.prompt_bin_mask_from_v1(prompt, V)
        p.output_bin_counts, _ = sampling_state.output_state_from_v1(
            outputs, V, "cpu", with_mask=False
        )
    else:
        slots = 2 * B + 1
        p.state_slots = torch.randperm(slots, generator=g)[:B].to(torch.int32)
        p.prompt_bin_mask = torch.zeros(slots, (V + 31) // 32, dtype=torch.int32)
        p.output_bin_counts = torch.zeros(slots, V, dtype=torch.int32)
    return p


def _seeded_params(B: int, V: int, runner: str) -> sampling.SamplingParamsTensors:
    """A batch of B seeded rows with temperature / top-k / top-p, seeds in V1's form."""
    from fuselane.plugin import sampler_v1

    gens = {r: torch.Generator().manual_seed(r) for r in range(B)}
    seeds, has_seed = sampler_v1._seeds_v1(gens, B, torch.device("cpu"))
    return sampling.SamplingParamsTensors(
        temperature=torch.full((B,), 0.8), top_k=torch.full((B,), 50, dtype=torch.int32),
        top_p=torch.full((B,), 0.95), seeds=seeds, has_seed=has_seed,
    )  # fmt: skip


_V2_TEMPLATE = sampling.SamplingParamsTensors(state_slots=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize(
    "runner,sets,template,batch,entry",
    [
        ("v1", sampler_hook.V1_WARM_PARAM_SETS, sampling.SamplingParamsTensors(),
         _penalized_params, "penalties"),
        ("v2", sampler_hook.V2_WARM_PARAM_SETS, _V2_TEMPLATE, _penalized_params, "penalties"),
        ("v1", sampler_hook.V1_WARM_PARAM_SETS, sampling.SamplingParamsTensors(),
         _seeded_params, "seeded"),
    ],
)  # fmt: skip
def test_warm_up_covers_penalized_and_seeded_batches(
    monkeypatch, runner, sets, template, batch, entry
):
    """Every batch size up to the workspace's (each launch configuration) with the usual
    sampling mix and penalties (or V1's seeded rows), logits writable as the samplers pass
    them, launches only kernel variants the start-up warm-up launched; without the set that
    names `entry` it would not."""
    max_batch, V = 160, 6000  # several launch configurations, two chunks a row
    ws = sampling.SamplingWorkspace.allocate(max_batch, V, torch.device("cpu"))

    def warm(param_sets):
        return _launched(
            monkeypatch, sampling.warm_up, template, ws, torch.float32, param_sets=param_sets,
            num_logprobs=None, logits_writable=True,
        )  # fmt: skip

    met: set[tuple] = set()
    for B in (1, 2, 5, 17, 66, 100, 160):
        met |= _launched(
            monkeypatch, sampling.fused_sample, torch.randn(B, V), batch(B, V, runner),
            workspace=ws, num_logprobs=None, logits_writable=True,
        )  # fmt: skip
    assert met <= warm(sets)
    plain = tuple(s for s in sets if entry not in s)
    assert len(plain) == len(sets) - 1
    assert not met <= warm(plain)


def test_warm_up_refuses_a_parameter_set_it_cannot_build():
    ws = sampling.SamplingWorkspace.allocate(2, 64, torch.device("cpu"))
    for bad in (("temperature", "min_p"), ("temperature", "output_mask")):
        with pytest.raises(ValueError, match="param_sets"):
            sampling.warm_up(
                sampling.SamplingParamsTensors(), ws, torch.float32, param_sets=(bad,),
                num_logprobs=None,
            )  # fmt: skip

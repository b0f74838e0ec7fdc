"""The one-launch fused sampler (kernels/sampling/row.py) against the torch reference and against
the two-launch path, under the Triton interpreter.

The one-launch kernel runs the chunk kernel's and the combine kernel's device functions in one
program per row, and the Gumbel noise is a function of (seed, offset, token) alone: for the same
inputs both paths keep the same sets and draw the same tokens, seeded or not (unseeded rows take
their seeds from torch's global generator, reseeded before each call here). Inputs are fresh
random logits; every output is poisoned before the call (`_ws`).
"""

from __future__ import annotations

import pytest
import torch

from fuselane.kernels import sampling as smp
from fuselane.kernels.sampling import SamplingParamsTensors, fused_sample
from fuselane.plugin.sampling_state import logit_bias_from_dicts, penalty_state_from_v1
from tests.allclose import assert_close
from tests.device import DEVICE, on_device
from tests.kernels.test_sampling import LP_TOL, _bits, _check, _logits, _params, _ws

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _launches(monkeypatch) -> list[str]:
    """Names of the sampling kernels launched from now on."""
    seen: list[str] = []
    real = smp.ops.launch

    def spy(fn, grid, *args, **kwargs):
        seen.append(fn.__name__)
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(smp.ops, "launch", spy)
    return seen


def _both(x, prm, *, n=0, mode="processed_logprobs", expect_fb=None, **ws_kw):
    """The one-launch path against the reference (`_check`), then against the two-launch path
    on the same inputs: the same tokens, kept sets and NaN counts; log-probabilities within the
    tolerance of fp32 sums in another order. Rows without a seed (compared with the two-launch
    path only: the reference draws its own) take the same seeds from the reseeded generator."""
    B, V = x.shape
    torch.manual_seed(5)
    one, _ = _check(x, prm, ws=_ws(B, V, one_launch=True, **ws_kw), num_logprobs=n, mode=mode,
                    expect_fb=expect_fb)  # fmt: skip
    torch.manual_seed(5)
    two = fused_sample(x, prm, workspace=_ws(B, V, one_launch=False), num_logprobs=n,
                       logprobs_mode=mode)  # fmt: skip
    assert torch.equal(one.token_ids, two.token_ids), (one.token_ids, two.token_ids)
    for name in ("nan_rows", "kept_count"):
        assert torch.equal(getattr(one, name), getattr(two, name)), name
    fin = torch.isfinite(two.kept_threshold)
    assert torch.equal(fin, torch.isfinite(one.kept_threshold))
    assert torch.equal(_bits(one.kept_threshold[fin]), _bits(two.kept_threshold[fin]))
    atol, rtol = LP_TOL[torch.float32]
    if n is not None:
        assert_close(one.logprob, two.logprob, atol=atol, rtol=rtol, what="logprob")
    if n:
        assert torch.equal(one.topn_ids, two.topn_ids)
    return one


def test_rule_plan_and_workspace(monkeypatch):
    """B <= 8 and V <= 32768 take one launch, and top-p without top-k up to 16 rows at any V;
    a larger batch or vocabulary, a chunk override or one_launch=False take two;
    one_launch=True takes one at any shape, chunk by chunk."""
    assert smp.use_one_launch(8, 32768) and not smp.use_one_launch(9, 32000)
    assert not smp.use_one_launch(1, 32769)
    chunk_max = smp.plan.ROW_CHUNK_MAX
    assert smp.row_launch(32000) == (chunk_max, min(smp.plan.ROW_CAP, chunk_max // 16), 16)
    assert smp.row_launch(1) == (smp.MIN_CHUNK, smp.CAP, 4)
    # the warm-up meets both paths: 1..8 one launch, 9.. two
    assert smp.launch_batches(16, 32000) == [1, 9]
    for max_batch, vocab in ((16, 32000), (256, 128256), (3, 5000)):
        batches = smp.launch_batches(max_batch, vocab)
        plans = {smp.launch_plan(b, vocab) for b in range(1, max_batch + 1)}
        assert {smp.launch_plan(b, vocab) for b in batches} == plans
    seen = _launches(monkeypatch)
    V = 64
    x = _logits(9, V, seed=2)
    prm = _params(9, temperature=torch.full((9,), 0.8))
    for B, kw, want in (
        (8, {}, ["_sample_row_kernel"]),
        (9, {}, ["_sample_chunk_kernel", "_sample_combine_kernel"]),
        (2, {"chunk": 128}, ["_sample_chunk_kernel", "_sample_combine_kernel"]),
    ):
        seen.clear()
        sub = on_device(SamplingParamsTensors(**{k: v[:B] for k, v in prm.__dict__.items()
                                                  if v is not None}))  # fmt: skip
        ws = _ws(B, V, one_launch=None, **kw)
        fused_sample(x[:B], sub, workspace=ws)
        assert seen == want, (B, kw, seen)
    # top-p without top-k: one launch up to ONE_LAUNCH_TOP_P_MAX_BATCH rows at any vocabulary
    # (V past ONE_LAUNCH_MAX_VOCAB: chunk by chunk), two beyond or with top-k; the host decides
    # from which tensors the batch carries (B=10 here, past ONE_LAUNCH_MAX_BATCH)
    assert smp.use_one_launch(16, 128256, top_p_only=True)
    assert not smp.use_one_launch(17, 128256, top_p_only=True)
    assert smp.launch_batches(32, 32000, top_p_only=True) == [1, 17]
    wide = _logits(10, 2000, seed=5)
    top_p = _params(10, top_p=torch.full((10,), 0.9), temperature=torch.full((10,), 0.8))
    for B, fields, want in (
        (10, ("top_p", "temperature"), ["_sample_row_kernel"]),
        (10, ("temperature",), ["_sample_chunk_kernel", "_sample_combine_kernel"]),
    ):
        seen.clear()
        sub = on_device(SamplingParamsTensors(**{k: getattr(top_p, k)[:B] for k in fields}))
        fused_sample(wide[:B], sub, workspace=_ws(B, 2000, one_launch=None))
        assert seen == want, (B, fields, seen)
    # one launch with 128-value chunks: 3 chunks of 64 candidates a row, in its planes
    ws = _ws(9, 300, one_launch=True, chunk=128)
    assert ws.plane >= 9 * 3 and ws.cand.numel() >= 9 * 3 * 64
    with pytest.raises(ValueError, match="row_cap: expected a power of two"):
        smp.SamplingWorkspace.allocate(2, 40, "cpu", row_cap=6)


_MIXES = {
    # T + top-p only (p = 1: off; p tiny: the maximum alone), a greedy row, an untruncated row
    "topp": dict(
        top_p=[0.95, 0.5, 1.0, 1e-6, 0.9, 0.99], temperature=[0.7, 1.0, 0.9, 1.0, 0.0, 1.3]
    ),
    # every mask together, a greedy row with masks (its processed logprobs masked), k = 1
    "all": dict(
        top_k=[50, 1, 0, 3, 20, 200],
        top_p=[0.9, 0.8, 0.95, 1.0, 0.7, 0.6],
        min_p=[0.05, 0.0, 0.1, 0.01, 0.0, 0.2],
        temperature=[0.7, 1.0, 1.3, 0.0, 0.5, 2.0],
    ),
}


@pytest.mark.parametrize("mix", sorted(_MIXES))
def test_option_mixes_match_reference_and_two_launches(mix):
    """Kept sets, seeded draws, processed logprobs and the top 3, the row as one chunk (V =
    2001: 2048 values a program; chunk by chunk: the fallback test below)."""
    B, V = 6, 2001
    kw = {k: torch.tensor(v, dtype=torch.int32 if k == "top_k" else torch.float32)
          for k, v in _MIXES[mix].items()}  # fmt: skip
    prm = _params(B, seed=len(mix), **kw)
    x = _logits(B, V, seed=len(mix))
    _both(x, prm, n=3)


def test_penalties_bias_raw_logprobs_and_unseeded_rows():
    """Penalties and logit bias through state slots, raw log-probabilities and their top 4
    (raw candidates listed apart), rows with and without a seed; the writable-logits path
    writes the reference's penalized values and draws the read-only tokens."""
    B, V, S = 4, 700, 6
    g = torch.Generator().manual_seed(3)
    outs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 12, 40, 3, 7, 100)]
    pm, oc, om = penalty_state_from_v1(torch.randint(0, V, (S, 50), generator=g), outs, V)
    x = _logits(B, V, seed=4)
    top = x.argsort(-1, descending=True)[:, :2]
    counts, toks, vals = logit_bias_from_dicts(
        {1: {int(top[0, 0]): -float("inf"), 17: 4.0}, 3: {int(top[2, 1]): 5.0}}, S, DEVICE
    )
    pen = dict(
        repetition_penalty=torch.tensor([1.2, 1.0, 0.7, 1.5]),
        frequency_penalty=torch.tensor([0.0, 0.3, 0.5, -0.2]),
        presence_penalty=torch.tensor([0.4, 0.0, 0.2, 0.1]),
        state_slots=torch.tensor([1, 3, 5, 2], dtype=torch.int32),
        prompt_bin_mask=pm,
        output_bin_counts=oc,
        output_bin_mask=om,
        temperature=torch.tensor([0.0, 0.9, 1.0, 1.7]),
        top_k=torch.tensor([0, 20, 0, 5], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0]),
        has_seed=torch.tensor([True, False, True, False]),
    )
    bias = dict(logit_bias_counts=counts, logit_bias_token_ids=toks, logit_bias_values=vals)
    prm = _params(B, seed=3, **{**pen, "has_seed": None}, **bias)
    _both(x, prm, n=4, mode="raw_logprobs")
    # rows without a seed: the same seeds from the reseeded global generator in both paths
    prm = _params(B, seed=3, **pen, **bias)
    tokens = []
    for one_launch in (True, False):
        torch.manual_seed(6)
        ws = _ws(B, V, one_launch=one_launch)
        tokens.append(fused_sample(x, prm, workspace=ws, num_logprobs=None).token_ids)
    assert torch.equal(*tokens)
    # in place (no bias, no raw logprobs): the penalized values written, the reference's tokens
    prm = _params(B, seed=3, **{**pen, "has_seed": None})
    xw = x.clone()
    out = fused_sample(xw, prm, workspace=_ws(B, V, one_launch=True), num_logprobs=None,
                       logits_writable=True)  # fmt: skip
    assert torch.equal(_bits(xw), _bits(smp.apply_penalties_reference(x.clone(), prm)))
    assert torch.equal(out.token_ids, smp.sample_reference(x, prm).token_ids)


def test_edge_rows_nan_rows_and_the_exact_fallback():
    """All -inf but one, all equal, a NaN, a row of NaN, k = 1, p = 1; then a list of 8
    candidates (row_cap) per chunk of 512, in turn, that cannot hold the kept sets: the exact
    fallback, still equal."""
    V = 999
    x = _logits(8, V, seed=21)
    x[0] = float("-inf")
    x[0, 500] = 3.0  # one finite logit
    x[1] = 0.25  # all equal: every token kept, the lowest id's noise decides
    x[2, 7] = float("nan")
    x[3] = float("nan")  # no finite value: token 0, V NaNs counted
    prm = _params(
        8,
        temperature=torch.tensor([0.7, 0.7, 0.7, 0.7, 1e-4, 1.0, 0.8, 0.0]),
        top_k=torch.tensor([5, 10, 1, 0, 0, 0, 40, 0], dtype=torch.int32),
        top_p=torch.tensor([0.5, 0.5, 1.0, 0.9, 0.9, 1.0, 0.95, 1.0]),
    )
    out = _both(x, prm, n=2)
    assert out.token_ids.tolist()[0] == 500 and out.token_ids.tolist()[3] == 0
    assert out.nan_rows.tolist()[2:4] == [1, V] and out.kept_count.tolist()[:2] == [1, V]
    # the fallback: 8 listed values per 512-value chunk
    prm = _params(4, temperature=torch.tensor([0.7, 3.0, 1.0, 0.0]),
                  top_k=torch.tensor([50, 0, 0, 30], dtype=torch.int32),
                  top_p=torch.tensor([0.9, 0.95, 1.0, 0.8]))  # fmt: skip
    out = _both(_logits(4, 1000, seed=11), prm, n=5, chunk=512, row_cap=8, expect_fb=True)
    assert (out.fallback_rows & 1)[:2].all()


def test_vocab_of_one():
    x = torch.tensor([[0.3], [float("nan")]], device=DEVICE)
    prm = _params(2, temperature=torch.tensor([1.0, 0.0]), top_k=torch.tensor([1, 1]))
    out = _both(x, prm, n=1)
    assert out.token_ids.tolist() == [0, 0] and out.nan_rows.tolist() == [0, 1]


def test_a_path_the_workspace_was_not_sized_for_is_refused(monkeypatch):
    """A workspace sized for two launches, met by a one-launch call (here a rule patched to
    take it): a ValueError naming the entries and candidates it needs, before any launch."""
    ws = _ws(4, 3000, one_launch=False)
    monkeypatch.setattr(smp.ops, "use_one_launch", lambda *a: True)
    ws.one_launch = None  # back to the rule
    prm = on_device(_params(4, top_p=torch.full((4,), 0.9)))
    with pytest.raises(ValueError, match=r"one launch of 4 rows x 3000 logits needs 4 \(row"):
        fused_sample(_logits(4, 3000, seed=1), prm, workspace=ws)

"""fused_sample (kernels/sampling/) against its torch reference, under the Triton interpreter.

Exact checks compare tokens (seeded rows draw the same token given the same noise), kept sets,
log-probabilities and top-n lists; statistical checks compare sampled frequencies with the
reference distribution by a chi-square test at p < 1e-3, with a deliberately biased sampler
shown to fail the same check. Small chunk/cap overrides force every code path (multi-chunk
merge, capped candidate lists, the exact row-pass fallback) at test sizes.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from fuselane.benchmarks.stats import chi_square_pvalue
from fuselane.kernels import sampling as smp
from fuselane.kernels.sampling import (
    LOGPROBS_MODES,
    SamplingParamsTensors,
    SamplingWorkspace,
    apply_bias_reference,
    apply_penalties_reference,
    fused_sample,
    gumbel_noise_reference,
    pack_bin_mask,
    process_logits_reference,
    sample_reference,
    unpack_bin_mask,
)
from fuselane.kernels.sampling import penalties as spen
from fuselane.plugin.sampling_state import logit_bias_from_dicts, penalty_state_from_v1
from tests.allclose import assert_close
from tests.device import DEVICE, on_device

# The interpreter evaluates both sides of tl.where with numpy (inf - inf, log2(0) in lanes that
# are then discarded): its RuntimeWarnings are noise here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ALPHA = 1e-3  # chi-square significance: p below this fails
# logprobs: fp32 accumulation in different orders (kernel: per-chunk partials) -> (atol, rtol)
LP_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-5, 2e-5)}


def _logits(B, V, *, seed=0, dtype=torch.float32, scale=3.0):
    """Realistic-ish logits: randn * scale plus a few strong tokens per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * scale
    hot = torch.randint(0, V, (B, 3), generator=g)
    x.scatter_add_(1, hot, torch.full((B, 3), 2.0 * scale))
    return x.to(DEVICE, dtype)


def _params(B, *, seed=0, **kw) -> SamplingParamsTensors:
    """Seeded rows by default (so the kernel and the reference draw the same tokens)."""
    g = torch.Generator().manual_seed(seed + 1)
    kw.setdefault("seeds", torch.randint(-(2**62), 2**62, (B,), generator=g, dtype=torch.int64))
    kw.setdefault("seed_offsets", torch.randint(0, 4096, (B,), generator=g, dtype=torch.int64))
    return on_device(SamplingParamsTensors(**kw))


def _ws(B, V, **kw) -> SamplingWorkspace:
    """torch's rounding by default: on a GPU too the kernel's values then equal the references'
    bit for bit (test_both_roundings_run_and_agree_within_two_ulp covers Triton's). Two
    launches by default (`one_launch=None`: the rule's path)."""
    kw.setdefault("max_logprobs", 8)
    kw.setdefault("arith", "torch")
    # Two launches unless a test asks for another path: the rule's one launch for small batches
    # has its own tests (test_sampling_one_launch.py, against this path and the reference),
    # and under the interpreter it is several times slower on these tests' shapes.
    kw.setdefault("one_launch", False)
    ws = SamplingWorkspace.allocate(B, V, DEVICE, **kw)
    # poison every output so a value the kernel forgot to write fails
    for t in (ws.logprob, ws.topn_logprobs, ws.kept_threshold):
        t.fill_(float("nan"))
    for t in (ws.token_ids, ws.topn_ids, ws.nan_rows, ws.kept_count, ws.fallback_rows):
        t.fill_(-7)
    return ws


def _kept_mask(z_ref: torch.Tensor, out) -> torch.Tensor:
    """The kernel's kept set, read through its threshold on the reference's processed values."""
    return (z_ref >= out.kept_threshold[:, None]) & (z_ref > float("-inf"))


def _check(logits, prm, *, ws=None, num_logprobs=0, mode="raw_logprobs", expect_fb=None):
    B, V = logits.shape
    ws = ws or _ws(B, V)
    out = fused_sample(logits, prm, workspace=ws, num_logprobs=num_logprobs, logprobs_mode=mode)
    ref = sample_reference(logits, prm, num_logprobs=num_logprobs, logprobs_mode=mode)
    z_ref = process_logits_reference(logits, prm)
    assert torch.equal(out.token_ids, ref.token_ids), (out.token_ids, ref.token_ids)
    assert torch.equal(out.nan_rows, ref.nan_rows)
    assert torch.equal(out.kept_count, ref.kept_count), (out.kept_count, ref.kept_count)
    has_fin = (z_ref > float("-inf")).any(-1)
    kept = _kept_mask(z_ref, out)
    assert torch.equal(kept[has_fin], (z_ref > float("-inf"))[has_fin]), "kept sets differ"
    atol, rtol = LP_TOL[torch.float32]
    if num_logprobs is not None:
        assert_close(out.logprob, ref.logprob, atol=atol, rtol=rtol, what=f"logprob ({mode})")
    if num_logprobs:
        assert torch.equal(out.topn_ids, ref.topn_ids), (out.topn_ids, ref.topn_ids)
        fin = ref.topn_logprobs > float("-inf")
        assert torch.equal(out.topn_logprobs > float("-inf"), fin)
        assert_close(
            out.topn_logprobs[fin],
            ref.topn_logprobs[fin],
            atol=atol,
            rtol=rtol,
            what=f"topn ({mode})",
        )
    if expect_fb is not None:
        assert bool((out.fallback_rows != 0).any()) == expect_fb, out.fallback_rows
    return out, ref


# ------------------------------------------------------------------------------------ noise


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Textbook MurmurHash3_x86_32, pure Python (independent of the torch emulation)."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * c1) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * c2) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_noise_is_murmur3_of_seed_position_token():
    """vLLM V2's noise: u = (murmur3(seed lo, seed hi, position, token) + 0.5) / 2^32."""
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**40) + 7], dtype=torch.int64)
    pos = torch.tensor([0, 5, 123456, 2**31 + 3, 77], dtype=torch.int64)
    toks = torch.tensor([0, 1, 31, 50000, 262143], dtype=torch.int64)
    g = gumbel_noise_reference(seeds, pos, toks).double()
    for b in range(len(seeds)):
        for j, t in enumerate(toks.tolist()):
            s = int(seeds[b]) & 0xFFFFFFFFFFFFFFFF
            data = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, int(pos[b]) & 0xFFFFFFFF, t)
            u = (_murmur3_x86_32(data) + 0.5) / 2**32
            want = -math.log(-math.log1p(-u))
            assert abs(g[b, j].item() - want) < 2e-5 * max(1.0, abs(want)), (b, t)


def test_noise_is_pure_function():
    s = torch.tensor([3, 3, 4], dtype=torch.int64)
    o = torch.tensor([9, 9, 9], dtype=torch.int64)
    g = gumbel_noise_reference(s, o, 64)
    assert torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    g2 = gumbel_noise_reference(s, o + 1, 64)
    assert not torch.equal(g[0], g2[0])


# ----------------------------------------------------------------------------------- greedy


def test_greedy_ties_inf_rows_and_nan_rows():
    V = 37
    x = _logits(6, V, seed=3)
    x[0, :] = 1.5  # all equal: lowest id wins
    x[1, [4, 20, 30]] = 100.0  # tie at the max: token 4
    x[2, :] = float("-inf")
    x[2, 33] = -5.0  # one finite logit
    x[3, 7] = float("nan")  # NaN is never sampled, counted
    x[3, 8] = 1e4
    x[4, :] = float("nan")  # no finite value: token 0, counted
    prm = _params(6, temperature=torch.zeros(6))
    out, _ref = _check(x, prm)
    assert out.token_ids.tolist()[:4] == [0, 4, 33, 8]
    assert out.nan_rows.tolist() == [0, 0, 0, 1, V, 0]
    want = torch.nan_to_num(x, nan=float("-inf")).argmax(-1)
    assert torch.equal(out.token_ids[:4], want[:4])


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", float("nan")),
        ("temperature", -0.5),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("top_p", 0.0),
        ("min_p", 2.0),
        ("min_p", float("nan")),
        ("min_p", -0.1),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", float("inf")),
        ("presence_penalty", float("nan")),
    ],
)
def test_parameters_outside_vllms_domain_give_token_minus_one(name, value):
    """A row whose parameter vLLM's SamplingParams would refuse gets token -1 and nan_rows -1
    (never a silent token 0 drawn from NaN scores); its neighbours are sampled as usual."""
    B, V = 3, 500
    x = _logits(B, V, seed=21)
    neutral = {
        "temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
        "frequency_penalty": 0.2, "presence_penalty": 0.1,
    }  # fmt: skip
    fields = {k: torch.full((B,), v) for k, v in neutral.items()}
    fields[name][1] = value
    pen = ("repetition_penalty", "frequency_penalty", "presence_penalty")
    S = B
    pm, oc, om = penalty_state_from_v1(torch.randint(0, V, (S, 8)), [[1, 2], [3], []], V)
    prm = _params(B, seed=4, prompt_bin_mask=pm, output_bin_counts=oc, output_bin_mask=om,
                  seeds=torch.arange(B, dtype=torch.int64), **fields)  # fmt: skip
    assert all(getattr(prm, f) is not None for f in pen)
    out = fused_sample(x, prm, workspace=_ws(B, V), num_logprobs=None)
    ref = sample_reference(x, prm, num_logprobs=None)
    assert out.token_ids.tolist()[1] == -1 and out.nan_rows.tolist()[1] == -1
    assert torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.nan_rows, ref.nan_rows)
    assert out.token_ids[0] >= 0 and out.token_ids[2] >= 0


@pytest.mark.parametrize("count", [7, 1000, -3])
def test_logit_bias_count_past_the_list_reads_only_the_list(count):
    """A bias count larger than the list uses the whole list and nothing past it (the values
    behind the list, in the next slot's row, must not leak in); a negative count uses none."""
    B, V = 2, 64
    x = _logits(B, V, seed=17, scale=0.01)  # distinct small values: no ties for the top-n
    toks = torch.tensor([[5, 6, 7], [40, 41, 42]], dtype=torch.int32)
    vals = torch.tensor([[10.0, 20.0, 30.0], [100.0, 200.0, 300.0]])
    counts = torch.tensor([count, 0], dtype=torch.int32)
    prm = _params(B, temperature=torch.zeros(B), logit_bias_counts=counts,
                  logit_bias_token_ids=toks, logit_bias_values=vals)  # fmt: skip
    out, _ = _check(x, prm, num_logprobs=3, mode="processed_logits")
    plain = x.argmax(-1).tolist()
    assert out.token_ids.tolist() == [7 if count > 0 else plain[0], plain[1]]
    if count > 0:
        assert out.topn_ids[0].tolist() == [7, 6, 5]


def test_logit_bias_lists_must_be_contiguous():
    B, V = 2, 64
    wide = torch.zeros(B, 6, dtype=torch.int32, device=DEVICE)  # sliced there: not a copy
    prm = _params(
        B,
        logit_bias_counts=torch.ones(B, dtype=torch.int32),
        logit_bias_token_ids=wide[:, :3],
        logit_bias_values=torch.zeros(B, 3),
    )
    with pytest.raises(ValueError, match=r"logit_bias_token_ids.*contiguous"):
        fused_sample(_logits(B, V), prm, workspace=_ws(B, V))


@pytest.mark.parametrize("V,chunk", [(1, None), (1000, None), (2111, 128)])
def test_greedy_equals_argmax(V, chunk):
    x = _logits(4, V, seed=V)
    prm = _params(4, temperature=torch.zeros(4))
    out, _ = _check(x, prm, ws=_ws(4, V, chunk=chunk))
    assert torch.equal(out.token_ids, x.argmax(-1))


# -------------------------------------------------------------------------------- kept sets

_COMBOS = {
    "topk": dict(top_k=[1, 5, 50, 0, 4231, 100]),
    "topp": dict(top_p=[0.9, 0.5, 1.0, 1e-6, 0.99, 0.3]),
    "minp": dict(min_p=[0.05, 0.0, 0.5, 1.0, 1e-4, 0.1]),
    "topk_topp": dict(top_k=[50, 10, 0, 1, 200, 20], top_p=[0.9, 0.8, 0.95, 0.5, 0.999, 1.0]),
    "all": dict(
        top_k=[50, 10, 0, 3, 200, 20],
        top_p=[0.9, 0.8, 0.95, 1.0, 0.7, 0.6],
        min_p=[0.05, 0.0, 0.1, 0.01, 0.001, 0.2],
    ),
}


@pytest.mark.parametrize("combo", sorted(_COMBOS))
def test_kept_sets_and_draws_match_reference(combo):
    B, V = 6, 2111  # V not a power of two; 5 chunks of 512
    kw = {}
    for name, vals in _COMBOS[combo].items():
        dt = torch.int32 if name == "top_k" else torch.float32
        kw[name] = torch.tensor(vals, dtype=dt)
    temps = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.5, 2.0])  # one greedy row with masks
    prm = _params(B, seed=len(combo), temperature=temps, **kw)
    x = _logits(B, V, seed=len(combo))
    _check(x, prm, ws=_ws(B, V, chunk=512), num_logprobs=3, mode="processed_logprobs")


def test_exact_fallback_paths():
    """cap=8 per 128-token chunk: top-k 50 and wide top-p/min-p sets cannot come from the lists,
    every row takes the exact row-pass fallback, and still matches the reference."""
    B, V = 4, 1500
    prm = _params(
        B,
        temperature=torch.tensor([0.7, 3.0, 1.0, 0.0]),
        top_k=torch.tensor([50, 0, 0, 30], dtype=torch.int32),
        top_p=torch.tensor([0.9, 0.95, 1.0, 0.8]),
        min_p=torch.tensor([0.0, 0.0, 0.001, 0.0]),
    )
    x = _logits(B, V, seed=11)
    out, _ = _check(
        x,
        prm,
        ws=_ws(B, V, chunk=128, cap=8),
        num_logprobs=5,
        mode="processed_logprobs",
        expect_fb=True,
    )
    assert (out.fallback_rows & 1).all() and (out.fallback_rows & 2).any()


def _three_row_penalties(V: int, *, with_out_mask: bool) -> dict:
    """Penalty fields for 3 rows: 30 random prompt ids each, outputs [1, 2, 2], [], [5] x 9."""
    pm, oc, om = penalty_state_from_v1(torch.randint(0, V, (3, 30)), [[1, 2, 2], [], [5] * 9], V)
    return dict(
        repetition_penalty=torch.tensor([1.3, 1.0, 0.9]),
        frequency_penalty=torch.tensor([0.2, 0.0, 0.1]),
        presence_penalty=torch.tensor([0.1, 0.5, 0.0]),
        prompt_bin_mask=pm,
        output_bin_counts=oc,
        output_bin_mask=om if with_out_mask else None,
    )


def test_fallback_raw_topn_with_penalties():
    B, V = 3, 700
    prm = _params(
        B,
        temperature=torch.tensor([0.8, 1.0, 0.0]),
        top_k=torch.tensor([40, 3, 0]),
        **_three_row_penalties(V, with_out_mask=False),
    )
    x = _logits(B, V, seed=5)
    _check(
        x, prm, ws=_ws(B, V, chunk=128, cap=4), num_logprobs=8, mode="raw_logprobs", expect_fb=True
    )


# ------------------------------------------------------------------------- penalties, bias


def test_penalty_helpers_roundtrip():
    V = 100
    m = torch.rand(3, V) < 0.2
    assert torch.equal(unpack_bin_mask(pack_bin_mask(m), V), m)
    pm, oc, om = penalty_state_from_v1(
        torch.tensor([[1, 2, V, V], [99, 0, 0, V], [V, V, V, V]]), [[3, 3, 4], [], [99]], V
    )
    assert oc[0, 3] == 2 and oc[0, 4] == 1 and oc[2, 99] == 1 and oc.sum() == 4
    assert unpack_bin_mask(pm, V)[1].nonzero().flatten().tolist() == [0, 99]
    assert torch.equal(unpack_bin_mask(om, V), oc > 0)


@pytest.mark.parametrize("with_out_mask", [True, False])
def test_penalties_and_bias_values(with_out_mask):
    """Processed values (processed_logits of the top 8 and the chosen token) vs the reference;
    rows map to state slots through state_slots; bias lists in V2's padded per-slot form."""
    B, V, S = 4, 3000, 6
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, V, (S, 50), generator=g)
    outs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 12, 40, 3, 7, 100)]
    x = _logits(B, V, seed=9)
    top = x.argsort(-1, descending=True)[:, :6]
    # rows 1 and 2 (slots 3, 5) have their largest logits among their output tokens
    outs[3] += [int(top[1, 0])] * 2
    outs[5] += [int(top[2, 0]), int(top[2, 2])]
    pm, oc, om = penalty_state_from_v1(prompts, outs, V)
    # bias: push a low token to the top, kill the argmax (min_tokens-style -inf), duplicates add
    biases = {
        1: {int(top[0, 0]): -float("inf"), 17: 40.0},
        3: {int(top[2, 1]): 5.0, 2999: 1.5},
        5: {0: -2.0},
    }
    counts, toks, vals = logit_bias_from_dicts(biases, S, DEVICE)
    prm = _params(
        B,
        temperature=torch.tensor([0.0, 0.9, 1.0, 1.7]),
        repetition_penalty=torch.tensor([1.2, 1.0, 0.7, 1.5]),
        frequency_penalty=torch.tensor([0.0, 0.3, 0.5, -0.2]),
        presence_penalty=torch.tensor([0.4, 0.0, 0.2, 0.1]),
        state_slots=torch.tensor([1, 3, 5, 2], dtype=torch.int32),
        prompt_bin_mask=pm,
        output_bin_counts=oc,
        output_bin_mask=om if with_out_mask else None,
        logit_bias_counts=counts,
        logit_bias_token_ids=toks,
        logit_bias_values=vals,
        top_k=torch.tensor([0, 20, 0, 5], dtype=torch.int32),
    )
    ws = _ws(B, V, chunk=1024)
    out, _ = _check(x, prm, ws=ws, num_logprobs=8, mode="processed_logits")
    assert out.token_ids[0] == 17  # greedy row 0 uses slot 1: bias +40 on token 17
    # normalised, with the penalized maxima: row 1 untruncated (the chunks' normalisers), row 2
    # top-p alone (cut by that mass)
    prm.top_k = torch.tensor([0, 0, 0, 5], dtype=torch.int32, device=DEVICE)
    prm.top_p = torch.tensor([1.0, 1.0, 0.7, 0.95], device=DEVICE)
    prm.min_p = torch.tensor([0.0, 0.0, 0.0, 0.1], device=DEVICE)
    _check(x, prm, ws=ws, num_logprobs=8, mode="processed_logprobs")
    # the reference's building blocks agree with a direct computation on one row
    y = apply_penalties_reference(apply_bias_reference(x.clone(), prm), prm)
    assert y[0, int(top[0, 0])] == float("-inf") and y[0, 17] > x[0].max()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, NaN compared equal to itself: one NaN pattern for every NaN (a GPU's
    arithmetic returns its canonical NaN, numpy keeps the input's payload)."""
    return torch.where(torch.isnan(t), float("nan"), t).view(torch.int32)


@pytest.mark.parametrize("with_out_mask,chunk,bit_steps", [(True, 2048, 1), (False, 4096, 4)])
def test_penalties_written_in_place(with_out_mask, chunk, bit_steps, monkeypatch):
    """logits_writable: the chunk programs write exactly the reference's penalized values
    (seen tokens only; NaN stays NaN, -inf stays -inf) and the sampler's outputs equal the
    read-only path's bit for bit. V = 9001: a partial last word (31 bits set) and a partial
    last chunk; one and four bit steps per iteration."""
    monkeypatch.setattr(spen, "BIT_STEPS", bit_steps)
    B, V, S = 5, 9001, 7
    g = torch.Generator().manual_seed(21)
    prompts = torch.randint(0, V, (S, 300), generator=g)
    prompts[2, :40] = torch.arange(V - 40, V)  # the partial last word
    outs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 0, 60, 9, 1, 30, 2)]
    x0 = _logits(B, V, seed=13)
    top = x0.argsort(-1, descending=True)[:, :3]
    outs[4] += [int(top[0, 0])] * 3  # row 0 (slot 4): its argmax is an output token
    pm, oc, om = penalty_state_from_v1(prompts, outs, V)
    seen = unpack_bin_mask(pm, V) | (oc > 0)
    slots = torch.tensor([4, 2, 6, 0, 2], dtype=torch.int64)
    s1 = seen[slots[1]].nonzero().flatten()
    x0[1, s1[0]] = float("nan")
    x0[1, s1[1]] = float("-inf")
    x0[3, 7] = float("nan")  # unseen in slot 0 unless drawn: counted either way
    prm = _params(
        B,
        temperature=torch.tensor([0.0, 0.9, 1.3, 0.7, 1.0]),
        top_k=torch.tensor([0, 40, 0, 5, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0]),
        repetition_penalty=torch.tensor([1.3, 1.1, 0.8, 1.0, 1.0]),
        frequency_penalty=torch.tensor([0.5, 0.2, -0.3, 0.4, 0.0]),
        presence_penalty=torch.tensor([0.0, 0.3, 0.1, -0.2, 0.0]),  # row 4: no penalty
        state_slots=slots,
        prompt_bin_mask=pm,
        output_bin_counts=oc,
        output_bin_mask=om if with_out_mask else None,
    )
    ws_r, ws_w = _ws(B, V, chunk=chunk), _ws(B, V, chunk=chunk)
    for n, mode in ((None, "raw_logprobs"), (4, "processed_logprobs")):
        xr, xw = x0.clone(), x0.clone()
        ref = fused_sample(xr, prm, workspace=ws_r, num_logprobs=n, logprobs_mode=mode)
        out = fused_sample(
            xw, prm, workspace=ws_w, num_logprobs=n, logprobs_mode=mode, logits_writable=True
        )
        assert torch.equal(_bits(xr), _bits(x0)), "read-only logits written"
        want = apply_penalties_reference(x0.clone(), prm)
        assert torch.equal(_bits(xw), _bits(want)), "in-place values differ from the reference"
        assert not torch.equal(_bits(xw), _bits(x0))
        assert torch.equal(out.token_ids, ref.token_ids), (out.token_ids, ref.token_ids)
        assert out.token_ids[0] != top[0, 0]  # greedy row: its penalized argmax lost
        for name in ("nan_rows", "kept_count", "kept_threshold"):
            assert torch.equal(getattr(out, name), getattr(ref, name)), name
        if n is not None:
            assert torch.equal(_bits(out.logprob), _bits(ref.logprob))
            assert torch.equal(out.topn_ids, ref.topn_ids)
            assert torch.equal(_bits(out.topn_logprobs), _bits(ref.topn_logprobs))
    assert int(out.nan_rows[1]) == 1 and int(out.nan_rows[3]) == 1
    _check(x0.clone(), prm, ws=_ws(B, V, chunk=chunk), num_logprobs=4, mode="processed_logprobs")


def test_writable_logits_left_alone_where_in_place_penalties_do_not_apply():
    """Raw log-probabilities read the logits, bias comes before penalties, bf16 cannot hold
    the penalized values: in each case the logits stay as they were and the result is the
    read-only one."""
    B, V = 3, 700
    pen = _three_row_penalties(V, with_out_mask=True)
    counts, toks, vals = logit_bias_from_dicts({0: {3: 2.0}}, B, DEVICE)
    bias = dict(logit_bias_counts=counts, logit_bias_token_ids=toks, logit_bias_values=vals)
    cases = [
        (torch.float32, {}, 3, "raw_logprobs"),
        (torch.float32, {}, 0, "raw_logits"),
        (torch.float32, bias, None, "raw_logprobs"),
        (torch.bfloat16, {}, None, "raw_logprobs"),
    ]
    for dtype, extra, n, mode in cases:
        prm = _params(B, temperature=torch.tensor([0.8, 1.0, 0.0]), **pen, **extra)
        x0 = _logits(B, V, seed=6, dtype=dtype)
        x = x0.clone()
        out = fused_sample(
            x, prm, workspace=_ws(B, V), num_logprobs=n, logprobs_mode=mode, logits_writable=True
        )
        assert torch.equal(x, x0), (dtype, extra.keys(), n, mode)
        ref = fused_sample(x0, prm, workspace=_ws(B, V), num_logprobs=n, logprobs_mode=mode)
        assert torch.equal(out.token_ids, ref.token_ids)
        assert torch.equal(out.kept_threshold, ref.kept_threshold)


# ------------------------------------------------------------------------------ seeds, RNG


def test_seeded_reproducibility_and_offsets():
    B, V = 6, 500
    x = _logits(1, V, seed=4, scale=0.3).expand(B, V).contiguous()  # flat: draws vary a lot
    seeds = torch.full((B,), 1234, dtype=torch.int64)
    same = torch.zeros(B, dtype=torch.int64)
    prm = _params(B, temperature=torch.ones(B), seeds=seeds, seed_offsets=same)
    ws = _ws(B, V)
    a = fused_sample(x, prm, workspace=ws).token_ids.clone()
    b = fused_sample(x, prm, workspace=ws).token_ids.clone()
    assert torch.equal(a, b) and (a == a[0]).all()  # same (seed, offset): same token in every row
    prm2 = _params(B, temperature=torch.ones(B), seeds=seeds, seed_offsets=torch.arange(B))
    c = fused_sample(x, prm2, workspace=ws).token_ids
    assert c.unique().numel() >= 5  # different offsets: different draws
    assert torch.equal(c, sample_reference(x, prm2).token_ids)


def test_unseeded_rows_use_device_generator():
    B, V = 6, 300
    x = _logits(1, V, seed=8, scale=0.2).expand(B, V).contiguous()
    has = torch.tensor([True, False, True, False, False, False])
    prm = on_device(
        SamplingParamsTensors(
            temperature=torch.ones(B), seeds=torch.full((B,), 77, dtype=torch.int64), has_seed=has
        )
    )
    ws = _ws(B, V)
    torch.manual_seed(0)
    a = fused_sample(x, prm, workspace=ws).token_ids.clone()
    b = fused_sample(x, prm, workspace=ws).token_ids.clone()
    assert a[0] == a[2] == b[0] == b[2]  # seeded rows: fixed
    assert not torch.equal(a[~has], b[~has])  # unseeded rows: fresh device seeds per call
    torch.manual_seed(0)
    assert torch.equal(fused_sample(x, prm, workspace=ws).token_ids, a)  # global generator


# ------------------------------------------------------------------------------- edge rows


def test_edge_rows():
    V = 999
    x = _logits(8, V, seed=21)
    x[4] = 0.25  # all equal logits
    x[5] = float("-inf")
    x[5, 500] = 3.0  # one finite logit
    prm = _params(
        8,
        temperature=torch.tensor([0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 1e-4, 1.0]),
        top_k=torch.tensor([V, 1, 0, 0, 10, 5, 0, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 1.0, 1e-9, 0.5, 0.5, 0.9, 1.0]),
    )
    out, _ref = _check(x, prm, num_logprobs=2, mode="processed_logprobs")
    assert out.kept_count.tolist()[:6] == [V, 1, V, 1, V, 1]  # ties at the k-th value are kept
    assert out.token_ids[1] == x[1].argmax() and out.token_ids[3] == x[3].argmax()
    assert out.token_ids[5] == 500 and out.token_ids[6] == x[6].argmax()


def test_vocab_of_one():
    x = torch.tensor([[0.3], [float("nan")]], device=DEVICE)
    prm = _params(2, temperature=torch.tensor([1.0, 0.0]), top_k=torch.tensor([1, 1]))
    out, _ = _check(x, prm)
    assert out.token_ids.tolist() == [0, 0] and out.nan_rows.tolist() == [0, 1]


def test_mixed_greedy_random_bf16():
    B, V = 6, 1100
    x = _logits(B, V, seed=13, dtype=torch.bfloat16)  # bf16 logits: many exact ties
    prm = _params(
        B,
        temperature=torch.tensor([0.0, 0.8, 0.0, 1.2, 0.6, 0.0]),
        top_k=torch.tensor([0, 40, 0, 0, 7, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.95, 1.0, 1.0]),
    )
    out, _ = _check(x, prm, ws=_ws(B, V, chunk=256), num_logprobs=4)
    assert torch.equal(out.token_ids[[0, 2, 5]], x.float().argmax(-1)[[0, 2, 5]])


@pytest.mark.parametrize(
    "mode,n",
    [(m, 5) for m in LOGPROBS_MODES]
    + [("raw_logprobs", 0), ("raw_logprobs", 1), ("processed_logprobs", 1)]
    + [("processed_logprobs", None)],
)
def test_logprobs_modes(mode, n):
    B, V = 4, 800
    x = _logits(B, V, seed=17)
    x[2, :400] = float("-inf")
    prm = _params(
        B,
        temperature=torch.tensor([0.8, 0.0, 1.0, 1.5]),
        top_k=torch.tensor([20, 0, 3, 0], dtype=torch.int32),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]),
    )
    # n = 1: a workspace sized for exactly one logprob (its scratch holds the top-2 list the
    # kernel builds for one)
    ws = _ws(B, V, chunk=256, **({"max_logprobs": 1} if n == 1 else {}))
    out, _ref = _check(x, prm, ws=ws, num_logprobs=n, mode=mode)
    if n is None:
        assert out.logprob is None and out.topn_ids is None
    if n and mode == "processed_logprobs":
        # removed tokens follow the kept ones with -inf (row 2 keeps 3 of them)
        assert (out.topn_logprobs[2, 3:] == float("-inf")).all()


def test_topn_pads_rows_with_few_finite_values():
    x = torch.full((2, 40), float("-inf"), device=DEVICE)
    x[0, [3, 9]] = torch.tensor([1.0, 2.0], device=DEVICE)
    x[1, 5] = 0.0
    prm = _params(2, temperature=torch.ones(2))
    out, _ = _check(x, prm, num_logprobs=4)
    assert out.topn_ids.tolist() == [[9, 3, -1, -1], [5, -1, -1, -1]]


# ---------------------------------------------------------------------------- statistics


def _chi_probs(logits, prm):
    z = process_logits_reference(logits, prm)
    return torch.softmax(z[0].double(), -1)


@pytest.mark.parametrize("trunc", [False, True])
def test_kernel_frequencies_chi_square(trunc):
    """One V=16 distribution replicated over 128 rows with distinct seeds: the kernel's draws
    pass the chi-square check against the reference probabilities and equal the reference's
    draws one for one, so the high-power check of the same sampler below (40k draws, which
    the interpreter cannot afford for the kernel; the GPU benchmark runs 65k kernel draws)
    covers the kernel."""
    B, V = 128, 16
    row = torch.linspace(-2.0, 2.0, V)[
        torch.randperm(V, generator=torch.Generator().manual_seed(1))
    ]
    x = row.expand(B, V).contiguous().to(DEVICE)
    kw = (
        dict(top_k=torch.full((B,), 12, dtype=torch.int32), top_p=torch.full((B,), 0.9))
        if trunc
        else {}
    )
    prm = on_device(
        SamplingParamsTensors(
            temperature=torch.full((B,), 0.9),
            seeds=torch.arange(B, dtype=torch.int64) * 7919 + 11,
            seed_offsets=torch.full((B,), 3, dtype=torch.int64),
            **kw,
        )
    )
    out = fused_sample(x, prm, workspace=_ws(B, V), num_logprobs=None)
    assert torch.equal(out.token_ids, sample_reference(x, prm).token_ids)
    counts = torch.bincount(out.token_ids, minlength=V)
    assert chi_square_pvalue(counts, _chi_probs(x, prm)) > ALPHA


def _reference_draws(probs_logits: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n draws from softmax(probs_logits) [V] with the reference Gumbel noise (distinct seeds)."""
    seeds = torch.arange(n, dtype=torch.int64) * 2654435761 + seed
    g = gumbel_noise_reference(seeds, torch.zeros(n, dtype=torch.int64), probs_logits.numel())
    return (probs_logits[None, :] + g).argmax(-1)


def test_reference_sampler_chi_square_and_power():
    """40k draws: the murmur3 Gumbel sampler matches the distribution (with and without a
    top-k/top-p mask), and moving 1% of the probability mass between two tokens fails."""
    V, n = 16, 40_000
    row = torch.linspace(-1.5, 1.5, V)
    probs = torch.softmax(row.double(), -1)
    draws = _reference_draws(row, n, seed=5)
    assert chi_square_pvalue(torch.bincount(draws, minlength=V), probs) > ALPHA
    prm = SamplingParamsTensors(
        temperature=torch.ones(1), top_k=torch.tensor([10]), top_p=torch.tensor([0.8])
    )
    z = process_logits_reference(row[None], prm)[0]
    draws = _reference_draws(z, n, seed=6)
    assert (
        chi_square_pvalue(torch.bincount(draws, minlength=V), torch.softmax(z.double(), -1)) > ALPHA
    )
    # deliberately biased sampler: 1% of mass moved from token 15 to token 0
    biased = probs.clone()
    biased[0] += 0.01
    biased[15] -= 0.01
    draws = _reference_draws(torch.log(biased).float(), n, seed=7)
    assert chi_square_pvalue(torch.bincount(draws, minlength=V), probs) < ALPHA


# ---------------------------------------------------------------------- API and bad input


def test_outputs_are_workspace_views_and_custom_op_fake():
    B, V = 2, 64
    ws = _ws(B, V)
    out = fused_sample(_logits(B, V), _params(B, temperature=torch.ones(B)), workspace=ws)
    assert out.token_ids.data_ptr() == ws.token_ids.data_ptr()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake_ws = SamplingWorkspace.allocate(B, V, "cpu")
        fused_sample(torch.randn(B, V), SamplingParamsTensors(), workspace=fake_ws)
        pm, oc, om = penalty_state_from_v1(torch.zeros(B, 1, dtype=torch.int64), [[1], []], V)
        pen = SamplingParamsTensors(
            repetition_penalty=torch.ones(B) * 1.2,
            prompt_bin_mask=pm,
            output_bin_counts=oc,
            output_bin_mask=om,
        )
        # penalties written in place: the op variant declared as writing the logits
        fused_sample(torch.randn(B, V), pen, workspace=fake_ws, logits_writable=True)
    assert smp.ops._fused_sample_into_pen_._opoverload._schema.arguments[0].alias_info.is_write
    assert smp.ops._fused_sample_into._opoverload._schema.arguments[0].alias_info is None


def _bad(match, logits=None, prm=None, **kw):
    logits = torch.randn(2, 40, device=DEVICE) if logits is None else logits.to(DEVICE)
    with pytest.raises(ValueError, match=match):
        fused_sample(logits, on_device(prm or SamplingParamsTensors()), **kw)


def test_bad_inputs():
    _bad("logits: expected 2 dimensions", logits=torch.randn(40))
    _bad("logits: expected dtype", logits=torch.randn(2, 40).double())
    _bad("logits: expected stride 1", logits=torch.randn(40, 2).t())
    _bad("logprobs_mode: expected one of", logprobs_mode="logits")
    _bad("num_logprobs: expected None or a value", num_logprobs=500)
    _bad("params.temperature: expected shape", prm=SamplingParamsTensors(temperature=torch.ones(3)))
    _bad("params.top_k: expected dtype", prm=SamplingParamsTensors(top_k=torch.ones(2)))
    _bad(
        "params.seeds: expected dtype",
        prm=SamplingParamsTensors(seeds=torch.ones(2, dtype=torch.int32)),
    )
    _bad(
        "params.has_seed: given without params.seeds",
        prm=SamplingParamsTensors(has_seed=torch.ones(2, dtype=torch.bool)),
    )
    _bad(
        "params.prompt_bin_mask: required",
        prm=SamplingParamsTensors(repetition_penalty=torch.ones(2)),
    )
    pm = torch.zeros(2, 2, dtype=torch.int32)
    _bad(
        "params.output_bin_counts: expected shape",
        prm=SamplingParamsTensors(
            repetition_penalty=torch.ones(2),
            prompt_bin_mask=pm,
            output_bin_counts=torch.zeros(2, 41, dtype=torch.int32),
        ),
    )
    _bad(
        "params.logit_bias_token_ids: required",
        prm=SamplingParamsTensors(logit_bias_counts=torch.zeros(2, dtype=torch.int32)),
    )
    _bad(
        "params.logit_bias_counts: required",
        prm=SamplingParamsTensors(logit_bias_values=torch.zeros(2, 3)),
    )
    _bad("workspace: sized for batch", workspace=SamplingWorkspace.allocate(1, 40, DEVICE))
    _bad(
        "num_logprobs: workspace allows",
        workspace=SamplingWorkspace.allocate(2, 40, DEVICE, max_logprobs=2),
        num_logprobs=3,
    )
    with pytest.raises(ValueError, match="chunk: expected a power of two"):
        SamplingWorkspace.allocate(2, 40, "cpu", chunk=100)
    with pytest.raises(ValueError, match="cap: expected a power of two"):
        SamplingWorkspace.allocate(2, 40, "cpu", cap=3)


# ----------------------------------------------------------------------------------------------
# Start-up warm-up: which launches it covers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch,vocab", [(256, 128256), (64, 151936), (8, 32000), (3, 5000)])
def test_launch_batches_cover_every_launch_configuration(max_batch, vocab):
    batches = smp.launch_batches(max_batch, vocab)
    configs = {smp.pick_launch(b, vocab) for b in range(1, max_batch + 1)}
    assert {smp.pick_launch(b, vocab) for b in batches} == configs
    assert len(batches) == len(configs) and batches[0] == 1


def test_warm_up_runs_each_parameter_set_at_each_configuration(monkeypatch):
    seen = []
    real = smp.fused_sample

    def spy(logits, params, **kwargs):
        given = tuple(
            f for f in ("temperature", "top_k", "top_p", "min_p") if getattr(params, f) is not None
        )
        seen.append(
            (logits.shape[0], given, params.state_slots is not None, kwargs["num_logprobs"])
        )
        return real(logits, params, **kwargs)

    monkeypatch.setattr(smp.ops, "fused_sample", spy)
    ws = smp.SamplingWorkspace.allocate(3, 300, DEVICE, max_logprobs=2)
    template = smp.SamplingParamsTensors(state_slots=torch.arange(3, device=DEVICE))
    sets = ((), ("temperature", "top_k", "top_p"))
    calls = smp.warm_up(template, ws, torch.float32, param_sets=sets, num_logprobs=None)
    assert calls == len(seen) == len(smp.launch_batches(3, 300)) * len(sets)
    assert {s[1] for s in seen} == set(sets)
    assert all(s[2] and s[3] is None for s in seen)


def test_logprob_counts_share_a_few_combine_variants(monkeypatch):
    """The combine kernel's top-n width (the one-launch kernel's, which merges as it does) is
    the narrowest of TOPN_WIDTHS that holds the request: 1 to 8 logprobs run one compiled
    variant, 9 to 32 another (both compiled at start-up)."""
    seen = []
    real = smp.ops.launch

    def spy(fn, grid, *args, **kwargs):
        if fn in (smp.combine._sample_combine_kernel, smp.row._sample_row_kernel):
            seen.append(kwargs["TP"])
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(smp.ops, "launch", spy)
    B, V = 2, 300
    x = _logits(B, V, seed=5)
    prm = _params(B, temperature=torch.tensor([0.0, 0.9]))
    ws = _ws(B, V, max_logprobs=9)
    for n in (1, 3, 8, 9):
        _check(x, prm, ws=ws, num_logprobs=n)
    assert seen == [8, 8, 8, 32]


# ----------------------------------------------------------------------------------------------
# Roundings: torch's (vLLM V1, the references) and Triton's (vLLM V2)
# ----------------------------------------------------------------------------------------------


def test_both_roundings_run_and_agree_within_two_ulp():
    """arith="triton" (vLLM V2's own Triton arithmetic: div.full.f32, fused multiply-adds) and
    arith="torch" (the references, vLLM V1): under the interpreter the same values; on a GPU
    thresholds within 2 ulp and the same greedy tokens."""
    B, V = 4, 3000
    x = _logits(B, V, seed=31)
    pen = _three_row_penalties(V, with_out_mask=True)
    pen = {k: torch.cat([v, v[:1]]) if isinstance(v, torch.Tensor) else v for k, v in pen.items()}
    prm = _params(
        B,
        temperature=torch.tensor([0.0, 0.7, 1.3, 0.9]),
        top_k=torch.tensor([0, 40, 0, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.8, 0.95]),
        **pen,
    )
    outs = {}
    for arith in ("torch", "triton"):
        ws = _ws(B, V, arith=arith)
        outs[arith] = fused_sample(x.clone(), prm, workspace=ws, num_logprobs=None)
    a, b = outs["torch"], outs["triton"]
    assert a.token_ids[0] == b.token_ids[0]  # greedy row
    if DEVICE.type == "cpu":
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(_bits(a.kept_threshold), _bits(b.kept_threshold))
    else:
        fin = torch.isfinite(a.kept_threshold)
        assert torch.equal(fin, torch.isfinite(b.kept_threshold))
        torch.testing.assert_close(
            b.kept_threshold[fin], a.kept_threshold[fin], atol=0.0, rtol=2.5e-7
        )
    with pytest.raises(ValueError, match=r"arith: expected one of \['triton', 'torch'\]"):
        SamplingWorkspace.allocate(B, V, DEVICE, arith="fast")


@pytest.mark.parametrize("S,V", [(1, 1), (3, 31), (2, 32), (4, 100), (2, 4099)])
def test_pack_bin_mask_sets_bit_t_mod_32_of_word_t_div_32(S, V):
    g = torch.Generator().manual_seed(V)
    mask = torch.rand(S, V, generator=g) < 0.3
    mask[:, 31::32] = True  # the sign bit of every full word
    packed = smp.pack_bin_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (S, (V + 31) // 32)
    for s in range(S):
        for w, word in enumerate(packed[s].tolist()):
            bits = [(word >> b) & 1 for b in range(32)]  # Python's >> of a negative int32 word
            want = [int(mask[s, 32 * w + b]) if 32 * w + b < V else 0 for b in range(32)]
            assert bits == want, (s, w)

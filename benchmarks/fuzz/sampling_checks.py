"""One `fused_sample` call against the reference, and the run-wide distribution check of the
rows that draw from torch's generator.

Exact where the contract is exact: NaN counts, kept sets (read through the kernel's threshold
on the reference's processed values), the tokens of greedy and seeded rows, top-n lists, and
the logits (untouched, or penalized in place to the reference's bits). Rounding is allowed
where the two compute differently: log-probabilities (fp32 partial sums against the
reference's), and with `arith="triton"` values a few ulps apart. A row whose mismatch is a
rounding tie (a top-p mass within AMBIG of p, a value within a few ulps of the threshold, two
Gumbel scores within AMBIG) is counted as ambiguous, not failed, as the GPU benchmark's
`sampling_workload.compare` does.

Unseeded rows cannot match the reference draw for draw: their token must be one the reference
keeps, and each draw's randomized probability integral transform u = F(t-) + U * p(t) (F the
reference's distribution over token ids, U uniform) is collected; over the run the u values must
be uniform (chi-square over PIT_BINS bins at p >= PIT_ALPHA), which any sampler drawing from
another distribution fails given enough draws.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from fuselane.benchmarks.fuzz.core import Mismatch, bits
from fuselane.benchmarks.stats import chi_square_pvalue
from fuselane.kernels import sampling as smp

AMBIG = 1e-4  # relative gap under which a mismatch is a rounding tie (sampling_workload.AMBIG)
ULP = 2.0**-23
# log-probabilities: the kernel tests' LP_TOL, plus a few ulps of the row's largest magnitude
# (log-softmax subtracts a log-sum-exp of the same size, rounded in fp32 by the kernel).
LP_ATOL = LP_RTOL = 2e-5
LP_ULPS = 16
PIT_BINS = 20
PIT_MIN_SAMPLES = 200
PIT_ALPHA = 1e-4
NEG_INF = float("-inf")


def _clean(logits: torch.Tensor) -> torch.Tensor:
    """The reference's raw values: fp32, NaN -> -inf, -0 -> 0."""
    x = logits.float()
    x = torch.where(torch.isnan(x), NEG_INF, x)
    return torch.where(x == 0, 0.0, x)


def _row(r: torch.Tensor) -> int:
    return int(r.nonzero()[0, 0])


def check_case(cfg: dict, logits, given, prm, out, hrng: random.Random) -> dict:
    """Raise Mismatch at the first difference the contract does not allow; return the case's
    counters and its unseeded rows' PIT values (`pit`)."""
    n, mode = cfg["num_logprobs"], cfg["mode"]
    triton_arith = cfg["arith"] == "triton"
    _check_logits(cfg, logits, given, prm, triton_arith)
    ref = smp.sample_reference(logits, prm, num_logprobs=n, logprobs_mode=mode)
    x = _clean(logits)
    y = smp.apply_penalties_reference(smp.apply_bias_reference(x, prm), prm)
    pre, greedy = smp.apply_temperature_reference(y, prm.temperature)
    z = smp.top_k_top_p_reference(smp.apply_min_p_reference(pre, prm.min_p), prm.top_k, prm.top_p)
    if not torch.equal(out.nan_rows, ref.nan_rows):
        r = _row(out.nan_rows != ref.nan_rows)
        raise Mismatch(f"nan_rows[{r}]: got {int(out.nan_rows[r])}, want {int(ref.nan_rows[r])}")
    ambiguous = _kept_sets(logits, prm, pre, z, out, ref, triton_arith)
    tok = out.token_ids
    if ((tok < 0) | (tok >= logits.shape[1])).any():
        r = _row((tok < 0) | (tok >= logits.shape[1]))
        raise Mismatch(f"token_ids[{r}]: {int(tok[r])} is not a token id")
    fin = z > NEG_INF
    if prm.seeds is None:
        seeded = torch.zeros_like(greedy)
    else:
        seeded = torch.ones_like(greedy) if prm.has_seed is None else prm.has_seed
    ties = _exact_draws(prm, z, greedy, (greedy | seeded) & ~ambiguous, tok, ref.token_ids)
    unseeded = ~(greedy | seeded | ambiguous)
    kept_tok = fin.gather(1, tok[:, None]).squeeze(1)
    has = fin.any(-1)
    bad = unseeded & ((has & ~kept_tok) | (~has & (tok != 0)))
    if bad.any():
        r = _row(bad)
        raise Mismatch(f"token_ids[{r}] = {int(tok[r])} (unseeded row): not in the reference's "
                       f"kept set of {int(ref.kept_count[r])} tokens")  # fmt: skip
    if n is not None:
        _check_logprobs(mode, n, x, pre, z, out, ref, ambiguous, triton_arith)
    return {
        "rows": len(tok), "greedy_rows": int(greedy.sum()), "seeded_random_rows":
        int((seeded & ~greedy).sum()), "unseeded_rows": int(unseeded.sum()),
        "ambiguous_rows": int(ambiguous.sum()), "ambiguous_draws": ties,
        "fallback_rows": int((out.fallback_rows != 0).sum()),
        "pit": _pit(z, tok, unseeded & has, hrng),
    }  # fmt: skip


def _check_logits(cfg: dict, logits, given, prm, triton_arith: bool) -> None:
    """Writable fp32 logits with penalties (no bias, no raw log-probabilities) hold the
    reference's penalized values after the call; any other logits are untouched."""
    raw_lp = cfg["num_logprobs"] is not None and cfg["mode"] in ("raw_logprobs", "raw_logits")
    in_place = (
        prm.has_penalties and cfg["writable"] and logits.dtype == torch.float32
        and not prm.has_bias and not raw_lp
    )  # fmt: skip
    if not in_place:
        if not torch.equal(bits(given), bits(logits)):
            raise Mismatch("logits: written by a call that must leave them as they are")
        return
    want = smp.apply_penalties_reference(logits.clone(), prm)
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(given), nan):
        raise Mismatch("logits penalized in place: NaN where the reference has none, or back")
    a, w, x = given[~nan], want[~nan], logits[~nan]
    same = a == w
    if triton_arith:  # fused multiply-adds: a few ulps of the terms, not of the difference
        same |= (a - w).abs() <= 8 * ULP * (2 * x.abs() + (w - x).abs() + w.abs())
    if not bool(same.all()):
        i = int((~same).nonzero()[0, 0])
        raise Mismatch(
            f"logits penalized in place: value {a[i].item():.9g}, want {w[i].item():.9g}"
        )


def _moved(prm, z: torch.Tensor, more: bool):
    """`prm` with its top-p and min-p moved by a rounding's worth towards keeping more tokens
    (`more`) or fewer: top-p by AMBIG (the kernel's fp32 masses against the reference's fp64),
    the min-p cut max(z) + log(min_p) by 16 ulps of the row's largest value (the kernel's own
    log). Both filters keep upper sets of the same values, monotone in each parameter, so the
    two moved sets bracket every set a rounding can give."""
    sign = 1.0 if more else -1.0
    changes = {}
    if prm.top_p is not None:
        p = prm.top_p
        moved = (p * (1 + sign * AMBIG)).clamp(max=0.9999999)
        changes["top_p"] = torch.where(p >= 1, p, moved)
    if prm.min_p is not None:
        big = torch.where(z > NEG_INF, z.abs(), 0.0).amax(-1)
        shift = 16 * ULP * big + 1e-6
        changes["min_p"] = (prm.min_p * torch.exp(-sign * shift)).clamp(max=1.0)
    return dataclasses.replace(prm, **changes)


def _kept_sets(logits, prm, pre, z, out, ref, triton_arith: bool) -> torch.Tensor:
    """Raise unless every row's kept set and count equal the reference's, or lie between the
    sets of parameters moved by a rounding (`_moved`); returns the rows that tie.

    The kernel's set is read through its threshold on the reference's processed values before
    the masks (`pre`): the same bits with torch's rounding, a few ulps apart with Triton's (then
    the tokens within 8 ulps of the threshold may be in or out). Every set here is an upper set
    of the same values (a chain), so containment is a comparison of sizes."""
    fin = z > NEG_INF
    thr = out.kept_threshold[:, None]  # -inf: every finite value kept; NaN (unwritten): none
    tol = torch.where(thr.isfinite(), thr.abs() * 8 * ULP, 0.0) if triton_arith else 0.0
    finite = pre > NEG_INF
    sure = ((pre >= thr + tol) & finite).sum(-1)
    maybe = ((pre >= thr - tol) & finite).sum(-1)
    kc = out.kept_count.long()
    ref_kc = fin.sum(-1)
    bad = ~((sure <= ref_kc) & (ref_kc <= maybe) & (kc == ref_kc))
    ambiguous = torch.zeros_like(bad)
    if not bad.any():
        return ambiguous
    if prm.top_p is not None or prm.min_p is not None:
        fewer = (smp.process_logits_reference(logits, _moved(prm, z, False)) > NEG_INF).sum(-1)
        more = (smp.process_logits_reference(logits, _moved(prm, z, True)) > NEG_INF).sum(-1)
        lo, hi = torch.maximum(sure, fewer), torch.minimum(maybe, more)
        ambiguous = bad & (lo <= kc) & (kc <= hi)
    wrong = bad & ~ambiguous
    if wrong.any():
        r = _row(wrong)
        raise Mismatch(
            f"row {r}: kept {int(kc[r])} tokens at threshold "
            f"{out.kept_threshold[r].item():.9g}, reference {int(ref.kept_count[r])} at "
            f"{ref.kept_threshold[r].item():.9g}"
        )
    return ambiguous


def _exact_draws(prm, z, greedy, rows, tok, ref_tok) -> int:
    """Greedy and seeded rows draw the reference's token; returns the ties (two scores within
    AMBIG: argmax of z, or of z + Gumbel noise, computed with other roundings)."""
    bad = rows & (tok != ref_tok)
    if not bad.any():
        return 0
    idx = bad.nonzero().flatten()
    seeds = prm.seeds[idx] if prm.seeds is not None else torch.zeros_like(idx)
    offsets = prm.seed_offsets[idx] if prm.seed_offsets is not None else None
    g = smp.gumbel_noise_reference(seeds, offsets, z.shape[1])
    s = torch.where(greedy[idx, None], z[idx], z[idx] + g)
    sk = s.gather(1, tok[idx, None]).squeeze(1)
    sr = s.gather(1, ref_tok[idx, None]).squeeze(1)
    tie = (sk - sr).abs() <= AMBIG * sr.abs().clamp(min=1.0)
    if not tie.all():
        j = int((~tie).nonzero()[0, 0])
        r = int(idx[j])
        kind = "greedy" if greedy[r] else "seeded"
        raise Mismatch(
            f"token_ids[{r}] ({kind} row): got {int(tok[r])} (score {sk[j].item():.9g}), "
            f"want {int(ref_tok[r])} (score {sr[j].item():.9g})"
        )
    return len(idx)


def _values(mode: str, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The log-probability mode's values (`sample_reference`'s), -inf where not finite."""
    vals = {
        "raw_logprobs": lambda: x.log_softmax(-1),
        "raw_logits": lambda: x,
        "processed_logits": lambda: z,
        "processed_logprobs": lambda: z.double().log_softmax(-1).float(),
    }[mode]()
    return torch.where(vals.isnan(), NEG_INF, vals)


def _check_logprobs(mode, n, x, pre, z, out, ref, ambiguous, triton_arith) -> None:
    """The chosen token's log-probability and the top-n list: values of the kernel's own tokens
    within rounding; ids equal to the reference's (near ties of processed values allowed with
    Triton's rounding, exact ties broken by the lowest id)."""
    processed = mode.startswith("processed")
    vals = _values(mode, x, z)
    src = z if processed else x
    big = torch.where(src > NEG_INF, src.abs(), 0.0).amax(-1)
    atol = (LP_ATOL + LP_ULPS * ULP * big)[:, None]
    rows = ~ambiguous if processed else torch.ones_like(ambiguous)  # a tie moves the values
    _close(out.logprob[:, None], vals.gather(1, out.token_ids[:, None]), atol, rows, "logprob")
    if not n:
        return
    ids, rid = out.topn_ids, ref.topn_ids
    differ = rows & (ids != rid).any(-1)
    if differ.any():
        key = pre if processed else x
        valid = (ids >= 0) & (ids < x.shape[1])
        near = torch.zeros_like(ids, dtype=torch.bool)
        if processed and triton_arith:
            kk = key.gather(1, ids.clamp(0, x.shape[1] - 1))
            kr = key.gather(1, rid.clamp(0, x.shape[1] - 1))
            near = valid & (rid >= 0) & ((kk - kr).abs() <= 8 * ULP * kr.abs() + 1e-30)
        wrong = differ & ((ids != rid) & ~near).any(-1)
        if wrong.any():
            r = _row(wrong)
            raise Mismatch(f"topn_ids[{r}]: got {ids[r].tolist()}, want {rid[r].tolist()}")
    pad = ids < 0
    if (rows[:, None] & pad & (out.topn_logprobs != NEG_INF)).any():
        r = _row((rows[:, None] & pad & (out.topn_logprobs != NEG_INF)).any(-1))
        raise Mismatch(f"topn_logprobs[{r}]: padding entries (id -1) are not -inf")
    want = vals.gather(1, ids.clamp(min=0))
    _close(out.topn_logprobs, want, atol, rows[:, None] & ~pad, "topn_logprobs")


def _close(got, want, atol, where, what: str) -> None:
    """Infinities equal, finite values within atol + LP_RTOL |want|, on `where`."""
    inf = torch.isinf(want) | torch.isinf(got)
    ok = torch.where(inf, got == want, (got - want).abs() <= atol + LP_RTOL * want.abs())
    bad = where & ~ok
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        raise Mismatch(f"{what}[{r}, {c}]: got {got[r, c].item():.9g}, want "
                       f"{want[r, c].item():.9g} (atol {float(atol[r, 0]):.3g})")  # fmt: skip


def _pit(z: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor, hrng: random.Random) -> list:
    """Randomized PIT values u = F(t-) + U * p(t) of the rows' draws under the reference's
    distribution softmax(z) over token ids (in chunks of rows: fp64 [rows, V])."""
    out = []
    idx = rows.nonzero().flatten()
    for part in idx.split(32):
        probs = torch.softmax(z[part].double(), -1)
        t = tok[part, None]
        p_t = probs.gather(1, t).squeeze(1)
        below = probs.cumsum(-1).gather(1, t).squeeze(1) - p_t
        jitter = torch.tensor([hrng.random() for _ in part], dtype=torch.float64, device=z.device)
        out += (below + jitter * p_t).clamp(0.0, 1.0).tolist()
    return out


def distribution_check(stats: dict) -> dict:
    """The run's unseeded draws: their PIT values uniform (chi-square, PIT_BINS bins)."""
    pit = stats.get("pit", [])
    result: dict = {"samples": len(pit), "tested": len(pit) >= PIT_MIN_SAMPLES, "ok": True}
    if result["tested"]:
        u = torch.tensor(pit, dtype=torch.float64)
        counts = torch.histc(u, bins=PIT_BINS, min=0.0, max=1.0)
        p = chi_square_pvalue(counts, torch.full((PIT_BINS,), 1.0 / PIT_BINS))
        result.update(bins=[int(c) for c in counts], p_value=p, alpha=PIT_ALPHA, ok=p >= PIT_ALPHA)
    return {"unseeded_draws": result}

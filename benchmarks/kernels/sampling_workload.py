"""The sampling script's workload (bench_sampling): its cases, logits and parameters, and the
comparison of one batch's sampling against the torch reference.

Logits are randn * 3 plus three strong tokens per row (a peaked, LLM-like head); parameters are
T=0.7, top-k 50, top-p 0.9 with every row seeded (as vLLM's V2 runner seeds it), with penalties
and min-p from random prompt / output token ids in the penalty cases. `compare` counts rows
whose mismatch is a rounding tie (kernel: fp32 sums, approximate exp/log/div; reference: fp64
top-p masses, IEEE ops) as "ambiguous", not as failures. `fuselane bench kernels` builds its
sampling cases with the same helpers (sampling_cases.py).
"""

from __future__ import annotations

import torch

from fuselane.kernels import sampling as smp
from fuselane.plugin import sampling_state

T, K, P = 0.7, 50, 0.9
CASES = [(1, 128256), (32, 128256), (256, 151936)]
# The rounding timed by default (--arith picks another): the one the sampler hook uses
# (kernels.sampling.ARITH_MODES), which is also what every sampling result before 2026-11-26
# measured.
ARITH = "triton"
MIN_P, REP, FREQ, PRES = 0.05, 1.1, 0.2, 0.3
PROMPT_LEN, OUTPUT_LEN = 2000, 256
AMBIG = 1e-4  # relative margin under which a mismatch is a rounding tie
ALPHA = 1e-3


def case_name(B: int, V: int, pen: bool) -> str:
    return f"B={B} V={V} T={T} k={K} p={P}" + (" +pen+minp" if pen else "")


def make_logits(
    B: int,
    V: int,
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
) -> torch.Tensor:
    """randn * scale plus three strong tokens per row (a peaked, LLM-like head)."""
    x = torch.randn(B, V, generator=gen, device=device) * scale
    hot = torch.randint(0, V, (B, 3), generator=gen, device=device)
    x.scatter_add_(1, hot, torch.full((B, 3), 2.0 * scale, device=device))
    return x.to(dtype)


def make_params(
    B: int,
    V: int,
    gen: torch.Generator,
    device: torch.device,
    *,
    pen: bool = False,
    greedy_rows: int = 0,
    **over: torch.Tensor | None,
) -> smp.SamplingParamsTensors:
    """T/k/p rows (seeded, V2-style); penalties from random prompt/output token ids."""
    f = dict(device=device)
    kw = dict(
        temperature=torch.full((B,), T, **f),
        top_k=torch.full((B,), K, dtype=torch.int32, **f),
        top_p=torch.full((B,), P, **f),
        seeds=torch.randint(-(2**62), 2**62, (B,), generator=gen, dtype=torch.int64, **f),
        seed_offsets=torch.randint(0, 8192, (B,), generator=gen, dtype=torch.int64, **f),
    )
    if greedy_rows:
        kw["temperature"][:greedy_rows] = 0.0
    if pen:
        prompt = torch.randint(0, V, (B, PROMPT_LEN), generator=gen, **f)
        out_ids = torch.randint(0, V, (B, OUTPUT_LEN), generator=gen, **f)
        pm, oc, om = sampling_state.penalty_state_from_v1(prompt, out_ids, V)
        kw.update(
            min_p=torch.full((B,), MIN_P, **f),
            repetition_penalty=torch.full((B,), REP, **f),
            frequency_penalty=torch.full((B,), FREQ, **f),
            presence_penalty=torch.full((B,), PRES, **f),
            prompt_bin_mask=pm,
            output_bin_counts=oc,
            output_bin_mask=om,
        )
    kw.update(over)
    return smp.SamplingParamsTensors(**kw)


def _with_top_p(prm: smp.SamplingParamsTensors, scale: float) -> smp.SamplingParamsTensors:
    d = dict(prm.__dict__)
    if d["top_p"] is not None:
        d["top_p"] = (d["top_p"] * scale).clamp(max=1.0)
    return smp.SamplingParamsTensors(**d)


def compare(
    logits: torch.Tensor,
    prm: smp.SamplingParamsTensors,
    ws: smp.SamplingWorkspace,
    *,
    num_logprobs: int | None = 5,
    mode: str = "processed_logprobs",
    writable: bool = False,
) -> tuple[bool, str, dict[str, int]]:
    """Kernel vs reference on one batch. Returns (ok, summary, details). writable: the kernel
    runs on a copy it may penalize in place (`logits_writable`)."""
    B, V = logits.shape
    out = smp.fused_sample(
        logits.clone() if writable else logits,
        prm,
        workspace=ws,
        num_logprobs=num_logprobs,
        logprobs_mode=mode,
        logits_writable=writable,
    )
    ref = smp.sample_reference(logits, prm, num_logprobs=num_logprobs, logprobs_mode=mode)
    z = smp.process_logits_reference(logits, prm)
    fin = z > float("-inf")
    thr = out.kept_threshold[:, None]
    tol = thr.abs() * 8 * 2**-23  # the kernel's z and the reference's differ by ulps (div.full)
    k_kept = (z >= thr - tol) & fin
    set_bad = (k_kept != fin).any(-1) & fin.any(-1)
    ambiguous = torch.zeros(B, dtype=torch.bool, device=logits.device)
    if set_bad.any():
        # a top-p boundary within AMBIG of p (fp32 vs fp64 masses) is a tie, not an error
        for s in (1 + AMBIG, 1 - AMBIG):
            zp = smp.process_logits_reference(logits, _with_top_p(prm, s))
            ambiguous |= set_bad & ((k_kept == (zp > float("-inf"))).all(-1))
        near = ((z - thr).abs() <= 64 * tol + 1e-30) & (k_kept != fin)
        ambiguous |= set_bad & ((k_kept == fin) | near).all(-1)
    tok_bad = (out.token_ids != ref.token_ids) & ~set_bad
    if tok_bad.any():
        # Gumbel scores of the two tokens within AMBIG: approximate log vs torch log
        g = smp.gumbel_noise_reference(prm.seeds, prm.seed_offsets, V)
        greedy = prm.temperature < smp.SAMPLING_EPS
        s = torch.where(greedy[:, None], z, z + g)
        sk = s.gather(1, out.token_ids[:, None]).squeeze(1)
        sr = s.gather(1, ref.token_ids[:, None]).squeeze(1)
        ambiguous |= tok_bad & ((sk - sr).abs() <= AMBIG * sr.abs().clamp(min=1.0))
    bad = (set_bad | tok_bad) & ~ambiguous
    same = ~(set_bad | tok_bad)
    lp_err = 0.0
    if num_logprobs is not None and same.any():
        lp_err = (out.logprob - ref.logprob)[same].abs().nan_to_num(float("inf")).max().item()
    tn_err = 0.0
    if num_logprobs and same.any():
        ids_ok = (out.topn_ids == ref.topn_ids).all(-1) & same
        if (~ids_ok & same).any():
            bad |= ~ids_ok & same & ~ambiguous
        f = (ref.topn_logprobs > float("-inf")) & ids_ok[:, None]
        if f.any():
            tn_err = (out.topn_logprobs - ref.topn_logprobs)[f].abs().max().item()
    nan_ok = torch.equal(out.nan_rows, ref.nan_rows)
    ok = (not bad.any()) and lp_err < 1e-3 and tn_err < 1e-3 and nan_ok
    fb = int((out.fallback_rows != 0).sum())
    summary = (
        f"rows {B}: exact {int(same.sum())}, ambiguous {int(ambiguous.sum())}, "
        f"mismatched {int(bad.sum())}; max |logprob err| {lp_err:.2e}, top-n {tn_err:.2e}; "
        f"nan_rows {'ok' if nan_ok else 'WRONG'}; fallback rows {fb}"
    )
    return ok, summary, {"fallback_rows": fb, "ambiguous": int(ambiguous.sum())}

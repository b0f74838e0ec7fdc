"""The sampling script's broad checks (bench_sampling), against the torch references on fresh
random logits; also its CPU smoke run (tiny shapes under Triton's interpreter).

Greedy equals argmax; kept sets, seeded draws, logprobs and top-n equal the reference over
several shapes and parameter mixes (penalties, bias, min-p, bf16, V up to 262144 and odd); NaN
rows reported; distribution: 65,536 draws of one V=16 row (4096 rows x 16 offsets) by a
chi-square test at p < ALPHA, with and without top-k/top-p. Rounding ties do not fail a check
(`sampling_workload.compare`).
"""

from __future__ import annotations

import traceback

import torch

from fuselane.benchmarks.kernels.sampling_sections import Runner
from fuselane.benchmarks.kernels.sampling_workload import (
    ALPHA,
    compare,
    make_logits,
    make_params,
)
from fuselane.benchmarks.stats import chi_square_pvalue
from fuselane.kernels import sampling as smp
from fuselane.plugin import sampling_state


def run_checks(run: Runner, gen: torch.Generator, small: bool) -> None:
    """Every check, a PASS / FAIL line each (`run.line`); `small`: the CPU smoke run's shapes."""
    dev = run.device
    shapes = (
        [
            (3, 1000, {}),
            (4, 5000, {"top_k": None}),
            (2, 3001, {"min_p": 0.1}),
            (3, 4099, {"pen": True}),
        ]
        if small
        else [
            (4, 128256, {}),
            (33, 151936, {}),
            (256, 32000, {}),
            (5, 262144, {}),
            (7, 100003, {"top_k": None}),  # top-p only
            (16, 128256, {"min_p": 0.1}),
            (8, 128256, {"top_k": 1000, "top_p": 1.0}),
            (8, 50000, {"pen": True}),
            (8, 50000, {"bias": True}),
            (12, 128256, {"greedy": 4, "dtype": torch.bfloat16}),
        ]
    )
    for B, V, opt in shapes:
        name = f"check B={B} V={V} {opt or 'T/k/p'}".replace("'", "")
        try:
            over = {}
            if "top_k" in opt:
                over["top_k"] = (
                    None
                    if opt["top_k"] is None
                    else torch.full((B,), opt["top_k"], dtype=torch.int32, device=dev)
                )
            if "top_p" in opt:
                over["top_p"] = torch.full((B,), opt["top_p"], device=dev)
            if "min_p" in opt:
                over["min_p"] = torch.full((B,), opt["min_p"], device=dev)
            if opt.get("bias"):
                biases = {
                    r: {
                        int(t): float(v)
                        for t, v in zip(
                            torch.randint(0, V, (20,), generator=gen, device=dev).tolist(),
                            (torch.randn(20, generator=gen, device=dev) * 5).tolist(),
                            strict=True,
                        )
                    }
                    for r in range(0, B, 2)
                }
                c, t, v = sampling_state.logit_bias_from_dicts(biases, B, dev)
                over.update(logit_bias_counts=c, logit_bias_token_ids=t, logit_bias_values=v)
            prm = make_params(
                B, V, gen, dev, pen=opt.get("pen", False), greedy_rows=opt.get("greedy", 0), **over
            )
            x = make_logits(B, V, gen, dev, dtype=opt.get("dtype", torch.float32))
            ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=run.arith)
            # raw logprobs differ from processed ones in the ordering only with bias/penalties
            modes = ["processed_logprobs"]
            if opt.get("pen") or opt.get("bias") or small:
                modes.append("raw_logprobs")
            for mode in modes:
                ok, summary, _ = compare(x, prm, ws, mode=mode)
                run.line(f"{name} {mode}", ok, summary)
            if opt.get("pen"):
                for n in (None, 5):  # penalties written in place (processed modes only)
                    ok, summary, _ = compare(x, prm, ws, num_logprobs=n, writable=True)
                    run.line(f"{name} logits_writable num_logprobs={n}", ok, summary)
        except Exception as e:  # noqa: BLE001 - a crash is a failure, reported like one
            traceback.print_exc()
            run.line(name, False, f"raised {e!r}")

    # greedy equals argmax, NaN rows reported
    B, V = (8, 3000) if small else (64, 128256)
    x = make_logits(B, V, gen, dev)
    x[1, 5] = float("nan")
    x[2, :] = float("nan")
    prm = make_params(B, V, gen, dev, temperature=torch.zeros(B, device=dev))
    ws = smp.SamplingWorkspace.allocate(B, V, dev, arith=run.arith)
    out = smp.fused_sample(x, prm, workspace=ws)
    want = torch.nan_to_num(x, nan=float("-inf")).argmax(-1)
    want[2] = 0
    nan_ok = out.nan_rows.tolist()[:3] == [0, 1, V]
    run.line(
        "greedy == argmax, NaN rows",
        torch.equal(out.token_ids, want) and nan_ok,
        f"{int((out.token_ids == want).sum())}/{B} tokens equal, nan_rows "
        f"{out.nan_rows.tolist()[:3]}",
    )

    # distribution: one V=16 row, 4096 rows x 16 offsets of distinct seeds
    rows, calls, V = (256, 2, 16) if small else (4096, 16, 16)
    row = torch.linspace(-2.0, 2.0, V, device=dev)[torch.randperm(V, generator=gen, device=dev)]
    x = row.expand(rows, V).contiguous()
    ws = smp.SamplingWorkspace.allocate(rows, V, dev, arith=run.arith)
    for trunc in (False, True):
        kw = (
            dict(
                top_k=torch.full((rows,), 12, dtype=torch.int32, device=dev),
                top_p=torch.full((rows,), 0.9, device=dev),
            )
            if trunc
            else {}
        )
        seeds = torch.arange(rows, dtype=torch.int64, device=dev) * 7919 + 5
        counts = torch.zeros(V, dtype=torch.int64, device=dev)
        equal = 0
        for c in range(calls):
            prm = smp.SamplingParamsTensors(
                temperature=torch.full((rows,), 0.9, device=dev),
                seeds=seeds,
                seed_offsets=torch.full((rows,), c, dtype=torch.int64, device=dev),
                **kw,
            )
            tok = smp.fused_sample(x, prm, workspace=ws, num_logprobs=None).token_ids
            counts += torch.bincount(tok, minlength=V)
            equal += int((tok == smp.sample_reference(x, prm).token_ids).sum())
        probs = torch.softmax(smp.process_logits_reference(x[:1], prm)[0].double(), -1)
        pval = chi_square_pvalue(counts, probs)
        n = rows * calls
        ok = pval > ALPHA and equal >= 0.999 * n
        run.line(
            f"distribution V=16 {'top-k 12 top-p 0.9' if trunc else 'untruncated'}",
            ok,
            f"{n} draws, chi-square p = {pval:.3g} (fails below {ALPHA}), "
            f"{equal}/{n} draws equal the reference's",
        )

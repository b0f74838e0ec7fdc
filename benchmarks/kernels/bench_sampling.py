"""GPU benchmark of the fused sampler (kernels/sampling/) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_sampling.py --out $OUT [--no-sweep]
Here (no GPU), the check code alone on tiny shapes under the interpreter:
    python benchmarks/kernels/bench_sampling.py --cpu-smoke

Order of work, in one process on one device:
  1. ceilings: copy bandwidth (1 GiB), empty Triton kernel;
  2. checks against the torch references on fresh random logits: greedy equals argmax; kept
     sets, seeded draws, logprobs and top-n equal the reference over several shapes and
     parameter mixes (penalties, bias, min-p, bf16, V up to 262144 and odd); NaN rows
     reported; distribution: 65,536 draws of one V=16 row (4096 rows x 16 offsets) by a
     chi-square test at p < 1e-3, with and without top-k/top-p. Rows whose mismatch is a
     rounding tie (kernel: fp32 sums, approximate exp/log/div; reference: fp64 top-p masses,
     IEEE ops) are counted as "ambiguous", reported, and do not fail a check;
  3. the goal cases (T=0.7, k=50, p=0.9; B=1/32 at V=128256, B=256 at V=151936; again
     with penalties + min-p): each is first checked on its own inputs (a failing case is not
     timed for fuselane), then fuselane and every peer are timed on the same inputs by
     CUDA-graph replay (`harness.time_graph`; eager with a note if capture fails);
  4. sweep (until BUDGET_S): other chunk sizes / warps / register caps than the launch rule
     picks, to set the table in kernels/sampling/plan.py from measurements;
  5. GOAL lines, the table; JSON to --out and benchmarks/results/.

fuselane is timed as the V2 plugin would call it: every row seeded (V2 keeps a seed per
request), no logprobs (the peers compute none), so with penalties the logits are writable
(`logits_writable`: each chunk program penalizes its seen tokens in place); one extra row per base
case adds raw logprobs with the top 5, one per penalty case keeps the logits read-only
(penalties applied to every value by the sampler itself). Bytes counted: the logits read
once (plus the dense output counts where they are read). Peers: FlashInfer 0.2.14
`top_k_top_p_sampling_from_logits` on logits already divided by T (temperature not timed for
it; with penalties, torch penalties/min-p in front of it), and `torch-sort (vLLM fallback)`:
the reference's sort-based top-k/top-p block (the same algorithm as vLLM's
apply_top_k_top_p_pytorch), softmax, exponential race (vLLM's random_sample), with the
reference's penalty / min-p blocks in front in the penalty cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # must precede `import torch` (it imports triton.language)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:  # an installed checkout (pip install -e .)
    from fuselane.benchmarks import harness
    from fuselane.benchmarks.stats import chi_square_pvalue
    from fuselane.kernels import sampling as smp
    from fuselane.kernels.sampling import penalties as spen
    from fuselane.plugin import sampling_state
except ImportError:  # a bare checkout (the GPU machine): the root folders are packages
    from benchmarks import harness
    from benchmarks.stats import chi_square_pvalue
    from kernels import sampling as smp
    from kernels.sampling import penalties as spen
    from plugin import sampling_state

T, K, P = 0.7, 50, 0.9
CASES = [(1, 128256), (32, 128256), (256, 151936)]
# The rounding timed: the one the sampler hook uses (kernels.sampling.ARITH_MODES), which is
# also what every sampling result before 2026-11-26 measured.
ARITH = "triton"
GOALS_MS = {1: 0.03, 32: 0.05, 256: 0.15}  # goals, H100/H200
PEN_RATIO_GOAL = 1.3
MIN_P, REP, FREQ, PRES = 0.05, 1.1, 0.2, 0.3
PROMPT_LEN, OUTPUT_LEN = 2000, 256
AMBIG = 1e-4  # relative margin under which a mismatch is a rounding tie
ALPHA = 1e-3
BUDGET_S = 210.0  # the sweep stops here; everything before it is needed
SWEEP = {  # (chunk or 0 = the rule's, warps or 0 = the rule's, maxnreg or 0); base cases
    256: [(4096, 4, 128), (4096, 8, 0), (2048, 4, 0)],
    32: [(4096, 8, 0), (1024, 4, 0)],
    1: [(2048, 4, 0), (2048, 8, 0)],
}  # fmt: skip
SWEEP_PEN = {  # the same with penalties (written in place, as timed) and min-p
    256: [(4096, 4, 128), (4096, 8, 0), (2048, 4, 0)],
    32: [(4096, 8, 0), (1024, 4, 0)],
    1: [(2048, 4, 0)],
}  # fmt: skip


def case_name(B: int, V: int, pen: bool) -> str:
    return f"B={B} V={V} T={T} k={K} p={P}" + (" +pen+minp" if pen else "")


def make_logits(B, V, gen, device, dtype=torch.float32, scale=3.0):
    """randn * scale plus three strong tokens per row (a peaked, LLM-like head)."""
    x = torch.randn(B, V, generator=gen, device=device) * scale
    hot = torch.randint(0, V, (B, 3), generator=gen, device=device)
    x.scatter_add_(1, hot, torch.full((B, 3), 2.0 * scale, device=device))
    return x.to(dtype)


def make_params(B, V, gen, device, *, pen=False, greedy_rows=0, **over):
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


def _with_top_p(prm, scale):
    d = dict(prm.__dict__)
    if d["top_p"] is not None:
        d["top_p"] = (d["top_p"] * scale).clamp(max=1.0)
    return smp.SamplingParamsTensors(**d)


def compare(logits, prm, ws, *, num_logprobs=5, mode="processed_logprobs", writable=False):
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


class Runner:
    def __init__(self, report, device, t_start, timing=True):
        self.report, self.device, self.t_start, self.timing = report, device, t_start, timing
        self.ok = True
        self.budget = BUDGET_S

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        if self.report is not None:
            self.report.notes.append(text)

    def line(self, name: str, ok: bool, summary: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {summary}", flush=True)
        if not ok:
            self.ok = False
            self.note(f"check FAIL {name}: {summary}")

    def time(self, section, case, impl, fn, *, nbytes=None, extra=None):
        extra = dict(extra or {})
        try:
            try:
                ms = harness.time_graph(fn, calls_per_graph=20, reps=30)
            except Exception as e:  # noqa: BLE001 - fall back to eager timing, say so
                torch.cuda.synchronize()
                ms = harness.time_eager(fn, reps=30)
                extra["timing"] = f"eager (graph capture failed: {type(e).__name__})"
                self.note(f"{case} {impl}: graph capture failed ({e!r}); eager timing")
        except Exception as e:  # noqa: BLE001 - an impl that cannot run is reported, not fatal
            self.note(f"{case} {impl}: timing failed: {e!r}")
            torch.cuda.synchronize()
            return None
        row = self.report.add(harness.Row(section, case, impl, ms, nbytes, None, extra))
        rate = f"{row.tbps:7.3f} TB/s" if row.tbps is not None else ""
        print(f"  {section:<8} {case:<44} {impl:<52} {ms * 1e3:9.2f} us {rate}", flush=True)
        return ms


def run_checks(run: Runner, gen, small: bool) -> None:
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
            ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=ARITH)
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
    ws = smp.SamplingWorkspace.allocate(B, V, dev, arith=ARITH)
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
    ws = smp.SamplingWorkspace.allocate(rows, V, dev, arith=ARITH)
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


def flashinfer_peer(run: Runner):
    try:
        import flashinfer.sampling as fis
    except Exception as e:  # noqa: BLE001 - any import failure disables this peer
        run.note(f"flashinfer: import failed: {e!r}")
        return None
    return fis


def bench_case(
    run: Runner, gen, B: int, V: int, pen: bool, fis, base_ms: dict, peers: bool = True
) -> None:
    dev = run.device
    name = case_name(B, V, pen)
    x = make_logits(B, V, gen, dev)
    prm = make_params(B, V, gen, dev, pen=pen)
    ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=ARITH)
    ok, summary, info = compare(x, prm, ws)
    run.line(f"case {name}", ok, summary)
    if ok and pen:
        # as the plugin calls it without logprobs: the seen tokens penalized in place
        ok, summary, info = compare(x, prm, ws, num_logprobs=None, writable=True)
        run.line(f"case {name} (logits_writable)", ok, summary)
    nbytes = x.numel() * x.element_size()
    ours = None
    if ok:
        # The writable calls penalize the same logits again on every call (663 per timing at
        # 1.1x: values stay finite): the same tokens, the same work.
        xw = x.clone()
        ours = run.time(
            "sampling",
            name,
            "fuselane",
            lambda: smp.fused_sample(xw, prm, workspace=ws, num_logprobs=None, logits_writable=pen),
            nbytes=nbytes,
            extra={"fallback_rows_in_check": info["fallback_rows"], "logits_writable": pen},
        )
        if not pen:
            base_ms[B] = ours
            run.time(
                "sampling",
                name,
                "fuselane (+raw logprobs, top 5)",
                lambda: smp.fused_sample(x, prm, workspace=ws, num_logprobs=5),
                nbytes=nbytes,
            )
        else:
            run.time(
                "sampling",
                name,
                "fuselane (read-only logits: penalties on every value)",
                lambda: smp.fused_sample(x, prm, workspace=ws, num_logprobs=None),
                nbytes=nbytes,
            )
            rule_steps = spen.BIT_STEPS
            for steps in sorted({1, 4} - {rule_steps}):
                spen.BIT_STEPS = steps  # read at every launch
                try:
                    impl = f"fuselane ({steps} bit steps per iteration)"
                    checked_time(run, name, impl, x, prm, ws, True)
                finally:
                    spen.BIT_STEPS = rule_steps
            dense = smp.SamplingParamsTensors(**{**prm.__dict__, "output_bin_mask": None})
            xd = x.clone()
            run.time(
                "sampling",
                name,
                "fuselane (dense output counts)",
                lambda: smp.fused_sample(
                    xd, dense, workspace=ws, num_logprobs=None, logits_writable=True
                ),
                nbytes=2 * nbytes,
            )
    else:
        run.note(f"{name}: check failed, fuselane not timed")
    temp = prm.temperature[:, None]

    def prologue():
        y = x
        if pen:
            y = smp.apply_penalties_reference(y, prm)
        z = y / temp
        if pen:
            z = smp.apply_min_p_reference(z, prm.min_p)
        return z

    def torch_sort():
        z = smp.top_k_top_p_reference(prologue(), prm.top_k, prm.top_p)
        probs = z.softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs).exponential_()
        return probs.div_(q).argmax(dim=-1)

    if not peers:
        return
    run.time("sampling", name, "torch-sort (vLLM fallback)", torch_sort, nbytes=nbytes)
    if fis is not None:
        z0 = (x / temp).contiguous()
        if pen:
            label = "torch penalties+min-p, flashinfer top_k_top_p"
            fn = lambda: fis.top_k_top_p_sampling_from_logits(
                prologue().contiguous(), prm.top_k, prm.top_p, deterministic=True
            )
        else:
            label = "flashinfer top_k_top_p_sampling_from_logits"
            fn = lambda: fis.top_k_top_p_sampling_from_logits(
                z0, prm.top_k, prm.top_p, deterministic=True
            )
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a failing peer is noted, the run goes on
            run.note(f"{name} flashinfer: call failed: {e!r}")
            return
        run.time("sampling", name, label, fn, nbytes=nbytes)


def run_profile(run: Runner, gen) -> None:
    """Device time per kernel of the rule's launch, from the CUDA profiler (which launch of
    the two holds the time)."""
    from torch.profiler import ProfilerActivity, profile

    dev = run.device
    for B, V in sorted(CASES, reverse=True):
        for pen in (False, True):
            x = make_logits(B, V, gen, dev)
            prm = make_params(B, V, gen, dev, pen=pen)
            ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=ARITH)
            for _ in range(3):
                smp.fused_sample(x, prm, workspace=ws, num_logprobs=None)
            torch.cuda.synchronize()
            calls = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    smp.fused_sample(x, prm, workspace=ws, num_logprobs=None)
                torch.cuda.synchronize()
            parts = []
            for ev in prof.key_averages():
                us = getattr(ev, "device_time_total", 0) or 0
                if us > 0:
                    parts.append(f"{ev.key[:40]} {us / calls:.1f} us")
            run.note(f"profile {case_name(B, V, pen)}: " + "; ".join(parts))


def run_sweep(run: Runner, gen) -> None:
    for B, V in sorted(CASES, reverse=True):
        for pen in (False, True):
            points = SWEEP_PEN.get(B, []) if pen else SWEEP[B]
            if points:
                sweep_case(run, gen, B, V, pen, points)
            if run.elapsed() > run.budget:
                run.note(f"sweep stopped at {run.elapsed():.0f} s (budget {run.budget:.0f} s)")
                return


def checked_time(run: Runner, name: str, impl: str, x, prm, ws, writable: bool) -> None:
    """Check `fused_sample` on x against the reference, then time it (on a copy of x when
    writable: the timed calls penalize it in place); a failed check is reported, not timed."""
    ok, summary, info = compare(x, prm, ws, num_logprobs=None, writable=writable)
    if not ok:
        run.line(f"sweep {name} {impl}", ok, summary)
        return
    xs = x.clone() if writable else x
    run.time(
        "sweep",
        name,
        impl,
        lambda: smp.fused_sample(
            xs, prm, workspace=ws, num_logprobs=None, logits_writable=writable
        ),
        nbytes=x.numel() * x.element_size(),
        extra={"fallback_rows_in_check": info["fallback_rows"]},
    )


def sweep_case(run: Runner, gen, B: int, V: int, pen: bool, points) -> None:
    """Time `fused_sample` at other launch configurations (chunk, warps, register cap) than
    the rule's, each checked first (penalty cases: logits writable, as timed)."""
    dev = run.device
    x = make_logits(B, V, gen, dev)
    prm = make_params(B, V, gen, dev, pen=pen)
    name = case_name(B, V, pen)
    rule_chunk, rule_warps, _ = smp.pick_launch(B, V, penalties=pen)
    for chunk, warps, maxnreg in points:
        if run.elapsed() > run.budget:
            return
        chunk, warps = chunk or rule_chunk, warps or rule_warps
        impl = f"fuselane chunk={chunk} warps={warps}" + (f" maxnreg={maxnreg}" if maxnreg else "")
        try:
            ws = smp.SamplingWorkspace.allocate(
                B,
                V,
                dev,
                max_logprobs=5,
                arith=ARITH,
                chunk=chunk,
                chunk_warps=warps,
                maxnreg=maxnreg or None,
            )
            checked_time(run, name, impl, x, prm, ws, pen)
        except Exception as e:  # noqa: BLE001 - keep the other configurations
            run.note(f"sweep {name} {impl}: {e!r}")
            torch.cuda.synchronize()


def goals(report, base_ms: dict) -> list[str]:
    lines = []
    for B, V in CASES:
        for pen in (False, True):
            name = case_name(B, V, pen)
            ours = next((r for r in report.rows if r.case == name and r.impl == "fuselane"), None)
            if ours is None:
                lines.append(f"GOAL {name}: not timed")
                continue
            goal = GOALS_MS[B]
            text = f"GOAL {name}: {ours.ms * 1e3:.1f} us vs <= {goal * 1e3:.0f} us"
            text += " MET" if ours.ms <= goal else " MISSED"
            if pen and base_ms.get(B):
                ratio = ours.ms / base_ms[B]
                text += f"; {ratio:.2f}x the base case (goal <= {PEN_RATIO_GOAL}x)"
                text += " MET" if ratio <= PEN_RATIO_GOAL else " MISSED"
            for r in report.rows:
                if r.case == name and r.impl != "fuselane" and not r.impl.startswith("fuselane"):
                    text += f"; {r.impl}: {r.ms / ours.ms:.1f}x slower"
            lines.append(text)
    return lines


def main() -> int:
    global ARITH
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=None,
        help="only the cases of these batch sizes (default: all of "
        + str([b for b, _ in CASES])
        + ")",
    )
    ap.add_argument("--no-peers", action="store_true", help="time fuselane only")
    ap.add_argument(
        "--no-checks",
        action="store_true",
        help="skip the broad checks (each timed case is still checked on its own inputs)",
    )
    ap.add_argument(
        "--tune",
        action="store_true",
        help="only the per-kernel profile and the sweep (no checks, no peers; own JSON name)",
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds before the sweep stops")
    ap.add_argument(
        "--arith",
        choices=smp.ARITH_MODES,
        default=ARITH,
        help=f"the kernel's rounding (default {ARITH}: vLLM V2's); another is named in the JSON",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: run the checks on tiny shapes under the Triton interpreter",
    )
    args = ap.parse_args()
    if args.batches:
        bad = [b for b in args.batches if b not in dict(CASES)]
        if bad:
            ap.error(f"--batches: {bad} not among the cases {[b for b, _ in CASES]}")
    t_start = time.perf_counter()
    if args.cpu_smoke:
        run = Runner(None, torch.device("cpu"), t_start, timing=False)
        run_checks(run, torch.Generator().manual_seed(0), small=True)
        print(f"cpu smoke: {'all PASS' if run.ok else 'FAILURES'} in {run.elapsed():.0f} s")
        return 0 if run.ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device: use --cpu-smoke here; the timed run needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator(device=dev).manual_seed(1234)
    ARITH = args.arith
    name = "sampling_tune" if args.tune else "sampling"
    report = harness.Report(name if ARITH == "triton" else f"{name}-arith-{ARITH}")
    report.notes.append(f"arith={ARITH}")
    copy_tbps = harness.copy_ceiling_tbps()
    empty_us = harness.empty_kernel_ms() * 1e3
    report.ceilings.update(copy_tbps=copy_tbps, empty_kernel_us=empty_us)
    print(
        f"{report.info['device']}: copy {copy_tbps:.3f} TB/s, empty Triton kernel "
        f"{empty_us:.2f} us",
        flush=True,
    )
    run = Runner(report, dev, t_start)
    run.budget = args.budget
    if args.tune:
        for section in (run_profile, run_sweep):
            try:
                section(run, gen)
            except Exception as e:  # noqa: BLE001 - keep the other section and the JSON
                run.note(f"{section.__name__} failed: {e!r}")
                traceback.print_exc()
        print(f"wrote {report.write(args.out)}")
        print(report.table())
        return 0 if run.ok else 1
    try:
        if args.no_checks:
            run.note("broad checks skipped (--no-checks)")
        else:
            run_checks(run, gen, small=False)
    except Exception as e:  # noqa: BLE001 - keep going to the timed cases and the JSON
        traceback.print_exc()
        run.line("checks", False, f"raised {e!r}")
    print(f"checks done at {run.elapsed():.0f} s ({'all PASS' if run.ok else 'NOT all PASS'})")
    cases = [(b, v) for b, v in CASES if not args.batches or b in args.batches]
    fis = None if args.no_peers else flashinfer_peer(run)
    base_ms: dict[int, float] = {}
    sections: list[Callable[[], None]] = [
        lambda b=b, v=v, p=p: bench_case(run, gen, b, v, p, fis, base_ms, not args.no_peers)
        for p in (False, True)
        for b, v in cases
    ]
    if not args.no_sweep:
        sections.append(lambda: run_sweep(run, gen))
    for section in sections:
        try:
            section()
        except Exception as e:  # noqa: BLE001 - keep the rest of the run and the JSON
            run.note(f"section failed: {e!r}")
            traceback.print_exc()
            torch.cuda.synchronize()
        print(f"  [{run.elapsed():.0f} s]", flush=True)
    try:
        goal_lines = goals(report, base_ms)
    except Exception as e:  # noqa: BLE001 - the JSON is written whatever happens here
        goal_lines = [f"goal evaluation failed: {e!r}"]
    report.notes.extend(goal_lines)
    print("\n".join(goal_lines))
    for out in (args.out, None):
        print(f"wrote {report.write(out)}")
    print(f"total {run.elapsed():.0f} s")
    print(report.table())
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())

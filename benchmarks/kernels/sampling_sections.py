"""The sampling script's timed goal cases (bench_sampling), with the runner that checks, times
and records them.

Each case (T=0.7, k=50, p=0.9; B=1/32 at V=128256, B=256 at V=151936; again with penalties and
min-p) is first checked on its own inputs (a failing case is not timed for fuselane), then
fuselane and every peer are timed on the same inputs by CUDA-graph replay (eager, and noted, if
capture fails). fuselane is timed as the V2 plugin calls it: every row seeded, no logprobs, so
with penalties the logits are writable (`logits_writable`); extra rows add raw logprobs with the
top 5 (base cases) or keep the logits read-only (penalty cases), and time the penalty kernel at
other bit steps per iteration and with dense output counts.

Peers: FlashInfer's `top_k_top_p_sampling_from_logits` on logits already divided by T (with
penalties, torch penalties / min-p in front of it), and `torch-sort (vLLM fallback)`: the
reference's sort-based top-k/top-p, softmax and exponential race (vLLM's random_sample).
"""

from __future__ import annotations

from types import ModuleType

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.sampling_workload import (
    ARITH,
    case_name,
    compare,
    make_logits,
    make_params,
)
from fuselane.kernels import sampling as smp
from fuselane.kernels.sampling import penalties as spen

BUDGET_S = 210.0  # the sweep stops here; everything before it is needed


class Runner(family_script.ScriptRunner):
    """Where a run's check lines, notes and timed rows go (the report is None in the CPU
    smoke run, which only checks), with the run's clock, sweep budget and rounding (`arith`)."""

    LOOP = (20, 30)  # a fixed loop, as this script always timed: calls per graph, replays
    EAGER_NOTE = "; eager timing"
    SECTION_WIDTH, US_WIDTH = 8, 9

    def __init__(
        self,
        report: harness.Report | None,
        device: torch.device,
        t_start: float,
        arith: str = ARITH,
    ) -> None:
        super().__init__(report, t_start)
        self.device, self.arith = device, arith
        self.ok = True
        self.budget = BUDGET_S

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        if self.report is not None:
            self.report.notes.append(text)

    def label(self, section: str, case: str, impl: str) -> str:
        return f"{case} {impl}"

    def line(self, name: str, ok: bool, summary: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {summary}", flush=True)
        if not ok:
            self.ok = False
            self.note(f"check FAIL {name}: {summary}")


def flashinfer_peer(run: Runner) -> ModuleType | None:
    """FlashInfer's sampling module, or None (noted) where it does not import."""
    try:
        import flashinfer.sampling as fis
    except Exception as e:  # noqa: BLE001 - any import failure disables this peer
        run.note(f"flashinfer: import failed: {e!r}")
        return None
    return fis


def bench_case(
    run: Runner,
    gen: torch.Generator,
    B: int,
    V: int,
    pen: bool,
    fis: ModuleType | None,
    base_ms: dict[int, float],
    peers: bool = True,
) -> None:
    """Check one goal case on its inputs, then time fuselane (and its variants) and the peers;
    a base case's fuselane time goes to `base_ms` (the penalty goal is relative to it)."""
    dev = run.device
    name = case_name(B, V, pen)
    x = make_logits(B, V, gen, dev)
    prm = make_params(B, V, gen, dev, pen=pen)
    ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=run.arith)
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
        if not family_script.try_run(run.note, f"{name} flashinfer", fn):
            return  # a failing peer is noted, the run goes on
        run.time("sampling", name, label, fn, nbytes=nbytes)


def checked_time(
    run: Runner,
    name: str,
    impl: str,
    x: torch.Tensor,
    prm: smp.SamplingParamsTensors,
    ws: smp.SamplingWorkspace,
    writable: bool,
) -> None:
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

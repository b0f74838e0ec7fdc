"""`fuselane bench kernels`: the grid, the interpreter smoke run end to end, the outputs, and the
runner's handling of FlashInfer rows that wait for their JIT build (all on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from fuselane.benchmarks.kernels import grid, suite
from fuselane.benchmarks.kernels.impls import Impl, Prepared
from fuselane.benchmarks.kernels.peers import FlashInferWarmup


def test_full_grid_covers_every_model_and_family_once_per_shape():
    cases = grid.build_grid()
    for section in (s for f in grid.FAMILIES for s in grid.SECTIONS[f]):
        keys = [c.key for c in cases if c.section == section]
        assert keys and len(keys) == len(set(keys)), section
        covered = {m for c in cases if c.section == section for m in c.models}
        assert covered == set(grid.MODELS), section
    # equal shapes share a case: both Llamas sample from one vocabulary, Llama-3-8B and
    # Mistral-7B write the same KV rows, but their attention differs by the sliding window
    sampling = {c.models for c in cases if c.section == "sampling"}
    assert ("llama-3-8b", "llama-3-70b-tp8") in sampling and len(sampling) == 4
    assert ("llama-3-8b", "mistral-7b") in {c.models for c in cases if c.section == "kv_write"}
    assert all(len(c.models) == 1 for c in cases if c.family == "attention")
    # model-major: a time budget cuts the last models, never a whole family
    first = [c.family for c in cases if c.models[0] == "llama-3-8b"]
    assert cases[: len(first)] == [c for c in cases if c.models[0] == "llama-3-8b"]
    assert set(first) == set(grid.FAMILIES)


def test_grid_selection_and_errors():
    cases = grid.build_grid(("sampling",), ("qwen-2.5-7b",), "quick")
    assert [c.label for c in cases] == ["B=1 V=152064", "B=64 V=152064"]
    with pytest.raises(ValueError, match="model 'x': expected one of llama-3-8b"):
        grid.build_grid(models=("x",))
    with pytest.raises(ValueError, match="family 'x'"):
        grid.build_grid(families=("x",))


def test_visible_pairs_counts_the_causal_window():
    from fuselane.benchmarks.kernels.attention_cases import visible_pairs

    for q_len, seq_len, window in [(1, 100, None), (7, 7, None), (50, 90, 32), (5, 40, 64)]:
        want = sum(
            min(p + 1, window or p + 1) for p in range(seq_len - q_len, seq_len)
        )  # the query at position p sees keys max(0, p - W + 1) .. p
        assert visible_pairs(q_len, seq_len, window) == want


def _rows(payload, section):
    return [r for r in payload["results"] if r["section"] == section]


@pytest.mark.timeout(120)
def test_interpret_smoke_run_writes_consistent_outputs(tmp_path):
    """The whole pipeline under Triton's interpreter: every section checked and timed, JSON,
    markdown and one PNG per family written, and the numbers in them agree."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.serving.cli", "bench", "kernels", "--interpret-smoke",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    (path,) = tmp_path.glob("kernels-cpu-*.json")
    payload = json.loads(path.read_text())
    assert payload["interpret"] is True and payload["failures"] == [] and not payload["skipped"]
    assert payload["peers"]["torch"] == torch.__version__
    assert set(payload["ceilings"]) == {"copy_tbps", "gemm_tflops"}
    smoke_sections = {c.section for c in grid.build_grid(grid="smoke")}
    for family in grid.FAMILIES:
        for section in (s for s in grid.SECTIONS[family] if s in smoke_sections):
            rows = _rows(payload, section)
            ours = [r for r in rows if r["impl"] == "fuselane"]
            assert len(ours) == 1, section
            assert ours[0]["check_ok"] is True and ours[0]["family"] == family
    for r in payload["results"]:
        assert r["us"] == round(r["ms"] * 1e3, 3)
        if r["nbytes"]:
            assert r["TBps"] == round(r["nbytes"] / (r["ms"] * 1e-3) / 1e12, 3)
            ceiling = payload["ceilings"]["copy_tbps"]
            assert r["pct_copy_ceiling"] == round(
                100 * r["nbytes"] / (r["ms"] * 1e-3) / 1e12 / ceiling, 1
            )
        else:
            assert r["flops"] and "TFLOPs" in r
        if r["impl"] != "fuselane":
            ours = next(o for o in _rows(payload, r["section"]) if o["impl"] == "fuselane")
            assert r["peer_over_fuselane"] == round(r["ms"] / ours["ms"], 3)
    # the torch peers ran where they can express the kernel
    peers = {(r["section"], r["impl"]) for r in payload["results"] if r["impl"] != "fuselane"}
    assert {("prefill", "torch-sdpa"), ("kv_write", "torch-index_copy"),
            ("sampling", "torch-sort (vLLM fallback)")} <= peers  # fmt: skip
    md = path.with_suffix(".md").read_text()
    assert "Interpreter smoke run" in md
    for r in payload["results"]:
        assert f"## {r['family']}: {r['section']}" in md and r["label"] in md
    for family in grid.FAMILIES:
        png = path.with_name(f"{path.stem}-{family}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", family
    assert "fuselane kernel benchmark" in proc.stdout  # the report is printed too
    # no terminal: plain progress lines instead of a bar
    assert "[1/8] decode tiny B=2 ctx=40" in proc.stdout


class _Events:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def begin(self, total: int) -> None:
        pass

    def case(self, label: str) -> None:
        pass

    def log(self, line: str) -> None:
        self.lines.append(line)

    def end(self) -> None:
        pass


class _Builds:
    """Stands in for FlashInferWarmup: every build is pending until the run waits for it."""

    def __init__(self, result: str) -> None:
        self.result, self.waited = result, []

    def state(self, key: str) -> str:
        return "pending"

    def wait(self, key: str, deadline: float | None) -> str:
        self.waited.append(key)
        return self.result


class _Family:
    """A family module with one case and two implementations, one waiting for a build."""

    def __init__(self) -> None:
        self.prepared = 0

    def warmups(self, case):
        return {"mod": {"kind": "sampling"}}

    def prepare(self, ctx, case):
        self.prepared += 1
        nothing = lambda: (lambda: None, lambda: (True, "ok"))
        impls = [Impl("fuselane", "fuselane", nothing), Impl("fi", "flashinfer", nothing, "mod")]
        return Prepared(impls, nbytes=1024)


@pytest.mark.parametrize("build", ["ready", "failed", "pending"])
def test_rows_waiting_for_a_build_run_at_the_end_or_are_listed(build, tmp_path):
    case = grid.build_grid(("sampling",), grid="smoke")[0]
    family = _Family()
    report = suite.harness.Report("kernels")
    ctx = suite.Context(torch.device("cpu"), None, "smoke", report.notes.append)
    opts = suite.Options(out=tmp_path, grid="smoke")
    state = suite._Run(opts, _Events(), ctx, report, {"sampling": family}, [], warm=_Builds(build))
    suite._run_case(state, case)
    assert [r.impl for r in report.rows] == ["fuselane"]
    assert state.deferred == {case: [("fi", "mod")]}
    suite._run_deferred(state)
    if build == "ready":
        assert [r.impl for r in report.rows] == ["fuselane", "fi"] and family.prepared == 2
        assert report.as_dicts()[1]["peer_over_fuselane"] > 0
    else:
        assert [r.impl for r in report.rows] == ["fuselane"] and family.prepared == 1
        why = "build failed" if build == "failed" else "build not done within the budget"
        assert state.skipped == [f"sampling {case.key} fi: {why}"]


def test_a_failed_flashinfer_build_is_reported_with_its_output():
    """The child process of a build that cannot happen here (no GPU, maybe no FlashInfer) fails,
    and the note carries the end of its output."""
    notes: list[str] = []
    warm = FlashInferWarmup({"sampling": {"kind": "sampling"}}, notes.append)
    try:
        assert warm.wait("sampling", time.monotonic() + 60) == "failed"
    finally:
        warm.close()
    assert notes and notes[0].startswith("FlashInfer build sampling failed (exit 1)")
    assert "Error" in notes[0]


def test_markdown_lists_peers_with_ratios():
    from fuselane.benchmarks.kernels import outputs

    row = dict(section="decode", case="m B=1 ctx=8", models="m", label="B=1 ctx=8",
               family="attention", nbytes=4e6)  # fmt: skip
    payload = {
        "device": "NVIDIA H200", "date": "2026-11-22", "torch": "2.11", "triton": "3.6",
        "grid": "full", "elapsed_s": 1.0, "ceilings": {"copy_tbps": 4.0},
        "peers": {"flashinfer": "0.2.14"}, "models": {},
        "results": [
            {**row, "impl": "fuselane", "us": 1.0, "TBps": 4.0, "pct_copy_ceiling": 100.0},
            {**row, "impl": "flashinfer", "us": 2.0, "peer_over_fuselane": 2.0, "check_ok": False},
        ],
    }  # fmt: skip
    md = outputs.markdown(payload)
    assert "| models | case | fuselane µs | TB/s | % of copy | flashinfer |" in md
    assert "| m | B=1 ctx=8 | 1.00 | 4 | 100 | 2.00 (2.00x) † |" in md
    assert outputs.stem(payload) == "kernels-h200-2026-11-22"


def test_a_sigterm_ends_the_run_with_the_cases_done_written(tmp_path, monkeypatch):
    """`timeout` (or a job runner) stopping a run keeps what it measured: the outputs are
    written with the cases run so far and a note that the run stopped early."""
    import os
    import signal

    from fuselane.benchmarks.kernels import cli

    real, seen = suite._run_case, []

    def run_case(state, case, only=None):
        seen.append(case.key)
        if len(seen) == 2:  # as `timeout` would, in the middle of the run
            os.kill(os.getpid(), signal.SIGTERM)
        return real(state, case, only)

    monkeypatch.setattr(suite, "_run_case", run_case)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --interpret-smoke sets it: undone after
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="stopped by signal"):
            cli.main(["--interpret-smoke", "--peers", "none", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, before)
    (path,) = tmp_path.glob("kernels-cpu-*.json")
    payload = json.loads(path.read_text())
    assert {r["label"] for r in payload["results"]} == {"B=2 ctx=40"}
    assert seen[0].endswith("B=2 ctx=40")
    assert any("stopped early" in n for n in payload["notes"])
    assert len(seen) == 2 < len(grid.build_grid(grid="smoke"))

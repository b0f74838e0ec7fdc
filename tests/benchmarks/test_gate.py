"""The performance gate's comparison on synthetic results files (no GPU, no timing)."""

from __future__ import annotations

import copy
import json

import pytest

from fuselane.benchmarks.kernels import gate


def run(device="NVIDIA H100 80GB HBM3", triton="3.6.0", **rows_us):
    """A results file with one fuselane row and one peer row per `name=us` (peer at 2x)."""
    results = []
    for name, us in rows_us.items():
        results.append({"section": "decode", "case": name, "impl": "fuselane", "us": us})
        results.append({"section": "decode", "case": name, "impl": "flashinfer", "us": 2 * us})
    return {"benchmark": "kernels", "device": device, "triton": triton, "results": results}


def test_equal_runs_pass_and_every_row_is_compared():
    base = run(a=10.0, b=100.0)
    report = gate.compare(copy.deepcopy(base), base)
    assert report.passed and not report.regressions
    assert len(report.rows) == 4 and sum(r.gated for r in report.rows) == 2


def test_a_fuselane_row_slower_than_the_threshold_fails_and_is_named():
    report = gate.compare(run(a=10.6, b=100.0), run(a=10.0, b=100.0), max_regression=0.05)
    assert not report.passed
    assert [(r.case, r.impl) for r in report.regressions] == [("a", "fuselane")]
    assert "SLOWER decode | a | fuselane: 10.600 us against 10.000 us (1.060x)" in report.text()
    assert report.text().endswith("FAIL")


def test_within_the_threshold_or_the_absolute_floor_passes():
    assert gate.compare(run(a=10.4), run(a=10.0), max_regression=0.05).passed
    # 1.3 -> 1.45 us is 11.5% but 0.15 us: the timer's granularity, not a regression
    assert gate.compare(run(a=1.45), run(a=1.3), max_regression=0.05).passed
    assert not gate.compare(run(a=1.45), run(a=1.3), min_delta_us=0.1).passed


def test_a_faster_row_and_a_slower_peer_pass():
    current = run(a=5.0)
    current["results"][1]["us"] = 100.0  # the peer got 5x slower: not fuselane's code
    assert gate.compare(current, run(a=10.0)).passed


def test_another_gpu_model_refuses_to_compare():
    with pytest.raises(gate.GateError, match=r"measured on .NVIDIA H100.*this run on .NVIDIA H200"):
        gate.compare(run(device="NVIDIA H200", a=1.0), run(a=1.0))


def test_other_versions_and_missing_rows_are_reported_not_compared():
    current = run(triton="3.9.0", a=10.0, c=3.0)
    current["models"] = {"llama-3-8b": {}}
    report = gate.compare(current, run(a=10.0, b=4.0))
    assert report.passed
    assert report.differences == {"triton": ("3.6.0", "3.9.0"), "models": ([], ["llama-3-8b"])}
    assert report.only_in_baseline == [("decode", "b", "fuselane")]
    assert report.only_in_current == [("decode", "c", "fuselane")]
    text = report.text()
    assert "triton differs" in text and "not measured in this run: decode | b" in text


def test_load_refuses_what_is_not_a_kernels_results_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"benchmark": "e2e"}))
    with pytest.raises(gate.GateError, match="not a `fuselane bench kernels` results file"):
        gate.load(bad)
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(gate.GateError, match="cannot read"):
        gate.load(tmp_path / "y.json")
    good = tmp_path / "z.json"
    good.write_text(json.dumps(run(a=1.0)))
    assert gate.load(good)["device"] == "NVIDIA H100 80GB HBM3"


def test_threshold_out_of_range_is_refused():
    with pytest.raises(gate.GateError, match="max_regression"):
        gate.compare(run(a=1.0), run(a=1.0), max_regression=-0.1)


def test_a_regression_timed_again_fails_only_if_slower_again():
    """The confirming run: a row slower again stays a regression, a row back within the
    thresholds moves to `unconfirmed` (the gate passes if none is left), a row the second run
    did not time stays a regression."""
    base = run(a=10.0, b=20.0, c=30.0)
    report = gate.compare(run(a=11.0, b=22.0, c=33.0), base)
    assert [r.case for r in report.regressions] == ["a", "b", "c"]
    again = run(a=10.9, b=20.3)  # c not timed again
    report = gate.confirm(report, again)
    assert [(r.case, r.rerun_us) for r in report.regressions] == [("a", 10.9), ("c", None)]
    assert [(r.case, r.rerun_us) for r in report.unconfirmed] == [("b", 20.3)]
    text = report.text()
    assert "| a | fuselane: 11.000 us against 10.000 us (1.100x; again 10.900 us)" in text
    assert "not confirmed decode | b | fuselane: 22.000 us, again 20.300 us, against 20" in text
    assert not report.passed
    only_noise = gate.confirm(gate.compare(run(b=22.0), run(b=20.0)), run(b=20.3))
    assert only_noise.passed and only_noise.text().endswith("PASS")


def test_the_confirming_run_times_the_failing_rows_sections_and_models():
    current = run(a=11.0, b=20.0)
    models = ["llama-3-8b/mistral-7b", "llama-3-8b", "qwen", "qwen"]  # a, a's peer, b, b's peer
    for r, names in zip(current["results"], models, strict=True):
        r["models"] = names
    current["results"].append(
        {"section": "sampling", "case": "z", "impl": "fuselane", "us": 1.0, "models": "gemma"}
    )
    report = gate.compare(current, run(a=10.0, b=20.0))
    assert gate.rerun_selection(report, current) == (["decode"], ["llama-3-8b", "mistral-7b"])
    with pytest.raises(gate.GateError, match="confirming run was measured on 'NVIDIA H200'"):
        gate.confirm(report, run(device="NVIDIA H200", a=11.0))


@pytest.mark.parametrize("again_us, status", [(10.2, 0), (11.0, 1)])
def test_the_cli_times_slower_rows_again_before_failing(tmp_path, monkeypatch, capsys, again_us,
                                                        status):  # fmt: skip
    """`fuselane bench kernels --baseline`: a first run with a slower row, then the confirming
    run of that row's section and model without peers (the benchmark suite itself replaced by
    one that writes the results files: no GPU here); exit 0 if the second run is back within
    the thresholds, 1 if it is slower again; --no-confirm fails on the first run."""
    from fuselane.benchmarks.kernels import cli, suite

    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(run(a=10.0)))
    calls = []

    def fake_run(opts, events):
        calls.append(opts)
        data = run(a=11.0 if len(calls) == 1 else again_us)
        for r in data["results"]:
            r["models"] = "llama-3-8b"
        opts.out.mkdir(parents=True, exist_ok=True)
        path = opts.out / "kernels.json"
        path.write_text(json.dumps(data))
        return suite.Outcome({"json": path}, [], [], 1.0, "")

    monkeypatch.setattr(suite, "run", fake_run)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --interpret-smoke sets it: undone after
    args = ["--interpret-smoke", "--out", str(tmp_path / "k"), "--baseline", str(baseline)]
    assert cli.main(args) == status
    first, second = calls
    assert (second.sections, second.models, second.peers) == (("decode",), ("llama-3-8b",),
                                                              frozenset())  # fmt: skip
    assert second.out == first.out / "confirm"
    out = capsys.readouterr().out
    assert ("not confirmed decode | a" in out) == (status == 0)
    calls.clear()
    assert cli.main([*args, "--no-confirm"]) == 1 and len(calls) == 1

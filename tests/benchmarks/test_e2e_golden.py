"""run_e2e's golden mode without a GPU: the arguments, the plan of a dry run, and writing and
checking a golden file from correctness passes (made up here, in run_correctness's format)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.benchmarks import test_e2e_script
from tests.benchmarks.test_e2e_script import REPO, SCRIPT

# The script loaded by path, as its own tests load it (a fixture).
e2e = test_e2e_script.e2e


@pytest.fixture(scope="module")
def golden(e2e):
    import golden  # put on sys.path by run_e2e, as the script's other parts

    return golden


def test_golden_arguments(e2e):
    a = e2e.parse_args(["--golden", "write", "--golden-file", "/tmp/g.json"])
    assert a.skip_online and a.arms == ["FLASH_ATTN", "fuselane", "TRITON_ATTN"]
    a = e2e.parse_args(["--golden", "check", "--golden-file", "g.json", "--arms", "fuselane"])
    assert a.arms == ["fuselane"]
    for bad in (
        ["--golden", "write"],
        ["--golden", "check", "--golden-file", "g", "--probe-only"],
        ["--golden", "check", "--golden-file", "g", "--online-only"],
        ["--golden", "read", "--golden-file", "g"],
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_dry_run_plans_the_golden_pass(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--golden", "write", "--golden-file",
         str(tmp_path / "g.json"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / ".no-such-dir")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((out / "e2e_results.json").read_text())["plan"]
    assert plan["correctness"]["output"] == 32 and plan["correctness"]["top_logprobs"] == 5
    assert plan["golden"]["mode"] == "write" and plan["online"] == []
    assert [a["name"] for a in plan["arms"]] == ["FLASH_ATTN", "fuselane", "TRITON_ATTN"]
    assert not (tmp_path / "g.json").exists()  # nothing is written without engines


def _pass(shift: float = 0.0, flip_last: bool = False) -> dict:
    """A correctness pass of two prompts, 3 greedy tokens each; `shift` moves every logprob,
    `flip_last` makes the last token of the second prompt the reference's runner-up."""
    prompts = []
    for p, base in enumerate((10, 20)):
        tokens = [base, base + 1, base + 2]
        top = [{str(t): -0.5 + shift, str(t + 100): -0.9 + shift} for t in tokens]
        if flip_last and p == 1:
            tokens[-1] += 100
            top[-1] = {str(tokens[-1]): -0.5 + shift, str(tokens[-1] - 100): -0.9 + shift}
        prompts.append(
            {
                "prompt_len": 4 * (p + 1),
                "token_ids": tokens,
                "top_logprobs": top,
                "prompt_logprobs": [None, -1.0 + shift, -2.0 + shift],
            }
        )
    return {"prompts": prompts}


def _report(fuselane: dict, triton: dict | None) -> dict:
    arms = {"FLASH_ATTN": {"correctness_raw": _pass()}, "fuselane": {"correctness_raw": fuselane}}
    if triton is not None:
        arms["TRITON_ATTN"] = {"correctness_raw": triton}
    return {"device": {"name": "NVIDIA H100"}, "versions": {"vllm": "0.26.0"}, "arms": arms}


def test_write_then_check(golden, e2e, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 4096}')
    path = tmp_path / "g" / "golden.json"
    written = golden.run("write", path, _report(_pass(0.004), _pass(0.01)), model)
    assert written["ok"] and written["bound_source"] == "this run"
    data = json.loads(path.read_text())
    assert data["reference"] == _pass() and data["bound"] == _pass(0.01)
    assert data["spec"]["output"] == 48 and data["spec"]["top_logprobs"] == 5
    fa = written["verdicts"]["FLASH_ATTN"]
    assert fa["ok"] and written["comparisons"]["FLASH_ATTN"]["prompts_identical"] == 2
    # A later run: FLASH_ATTN reproduces the file, fuselane within the bound, TRITON_ATTN from
    # the file (not run this time).
    later = _report(_pass(0.015), None)
    later["arms"]["FLASH_ATTN"]["correctness_raw"] = _pass()
    later["versions"] = {"vllm": "0.26.1"}
    checked = golden.run("check", path, later, model)
    assert checked["ok"] and checked["bound_source"] == "the file"
    assert checked["changed_since_file"] == {
        "versions": {"file": {"vllm": "0.26.0"}, "this run": {"vllm": "0.26.1"}}
    }
    gen = checked["verdicts"]["fuselane"]["checks"]["max_abs_logprob_diff_generated"]
    assert gen["value"] == pytest.approx(0.015) and gen["bound"] == pytest.approx(0.02)
    # Beyond the bound (2 x TRITON_ATTN's 0.01, at least 0.02): FAIL.
    assert not golden.run("check", path, _report(_pass(0.05), None), model)["ok"]
    # A divergence where the reference's runner-up is 0.4 behind: beyond any tie: FAIL.
    flipped = golden.run("check", path, _report(_pass(flip_last=True), None), model)
    assert not flipped["ok"]
    assert flipped["verdicts"]["fuselane"]["checks"]["divergences_beyond_tolerance"]["value"] == 1
    # An arm that ran no pass (failed or skipped) fails the check; TRITON_ATTN may be missing.
    broken = _report(_pass(), None)
    broken["arms"]["fuselane"] = {"status": "failed"}
    res = golden.run("check", path, broken, model)
    assert not res["ok"] and res["without_pass"] == ["fuselane"]
    assert "FAIL: no correctness pass from fuselane" in "\n".join(golden.lines(res))
    report = {"arms": {}, "golden": flipped}
    text = e2e.table(report)
    assert f"golden check {path}" in text and "fuselane: FAIL" in text


def test_check_refuses_a_file_of_other_inputs(golden, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = tmp_path / "golden.json"
    assert golden.run("write", path, _report(_pass(), _pass()), model)["ok"]
    data = json.loads(path.read_text())
    other = copy.deepcopy(data)
    other["spec"]["prompts"]["seed"] += 1
    path.write_text(json.dumps(other))
    res = golden.run("check", path, _report(_pass(), _pass()), model)
    assert not res["ok"] and "written for other inputs: prompts" in res["error"]
    missing = golden.run("check", tmp_path / "none.json", _report(_pass(), _pass()), model)
    assert not missing["ok"] and "FileNotFoundError" in missing["error"]
    no_bound = golden.run("write", tmp_path / "w.json", _report(_pass(), None), model)
    assert not no_bound["ok"] and "TRITON_ATTN" in no_bound["error"]
    assert not (tmp_path / "w.json").exists()

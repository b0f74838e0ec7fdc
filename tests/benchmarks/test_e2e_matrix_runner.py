"""benchmarks/e2e/matrix.py: the end-to-end cells from a queue, one GPU each: the queue and the
deadline (a fake process and clock), the cells' commands, and a real run of two cells of
run_e2e.py's dry run side by side (no engine, no GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.benchmarks.test_e2e_script import REPO, load_script

MATRIX = REPO / "benchmarks" / "e2e" / "matrix.py"


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("e2e_matrix_under_test", MATRIX)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class FakeProcess:
    """Ends after `polls` polls with `rc`."""

    def __init__(self, polls: int, rc: int = 0) -> None:
        self.left, self.returncode = polls, None
        self.rc = rc

    def poll(self):
        self.left -= 1
        if self.left <= 0:
            self.returncode = self.rc
        return self.returncode


def test_cells_share_the_gpus_from_a_queue(matrix, tmp_path):
    started = []

    def start(cmd, env, log):
        started.append((cmd[cmd.index("--out") + 1], env["CUDA_VISIBLE_DEVICES"]))
        return FakeProcess(polls=2 if len(started) == 1 else 4, rc=0 if len(started) != 3 else 1)

    names = ["default-llama-3-8b", "default-qwen2.5-7b", "sampling-qwen2.5-1.5b"]
    records = matrix.run(names, tmp_path, ["3", "5"], deadline_s=3600, start=start, poll_s=0)
    # The first two start at once; the third takes the GPU of the first to end.
    assert [gpu for _, gpu in started] == ["3", "5", "3"]
    assert [r["cell"] for r in records] == names
    assert [r["rc"] for r in records] == [0, 0, 1]
    assert all(r["status"] == "started" and r["budget_s"] == 530 for r in records)
    assert started[2][0] == str(tmp_path / "sampling-qwen2.5-1.5b")


def test_a_cell_that_would_overrun_the_deadline_is_not_started(matrix, tmp_path):
    now = [0.0]

    def start(cmd, env, log):
        return FakeProcess(polls=1)

    def clock():
        now[0] += 100.0  # every look at the clock: 100 s later
        return now[0]

    names = ["long-prompts-llama-3-8b", "default-gemma-2-9b"]
    records = matrix.run(names, tmp_path, ["0"], deadline_s=600, start=start, clock=clock,
                         poll_s=0)  # fmt: skip
    first, second = records
    assert first["status"] == "started" and first["budget_s"] == 485  # 600 - 100 - 15 margin
    assert second["status"] == "not started" and "expected 520 s" in second["reason"]
    lines = matrix.summary_lines(records)
    assert any("not started: expected 520 s" in line for line in lines)


def test_reverse_runs_a_cells_arms_the_other_way_and_bad_arguments_are_refused(matrix, tmp_path):
    cell = matrix.CELLS["default-llama-3-8b"]
    fwd = cell.command(tmp_path, tmp_path / "w", 400, reverse=False)
    rev = cell.command(tmp_path, tmp_path / "w", 400, reverse=True)
    arms = lambda cmd: cmd[cmd.index("--arms") + 1 : cmd.index("--out")]
    assert arms(fwd) == ["FLASH_ATTN", "fuselane", "TRITON_ATTN"] == arms(rev)[::-1]
    assert fwd[fwd.index("--budget-s") + 1] == "400" and "--no-results-copy" in fwd
    for bad in (["--cells", "nope"], ["--gpus", "0"], ["--deadline-s", "10"]):
        with pytest.raises(SystemExit):
            matrix.parse_args([*bad, "--out", str(tmp_path)])
    assert matrix.visible_devices(2, {"CUDA_VISIBLE_DEVICES": "4,6,7"}) == ["4", "6"]
    assert matrix.visible_devices(2, {}) == ["0", "1"]


def test_more_gpus_than_the_visible_devices_stop_the_run(matrix, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(SystemExit, match=r"names 1 device"):
        matrix.main(["--gpus", "2", "--dry-run", "--out", str(tmp_path)])
    assert not (tmp_path / "matrix.json").exists()


def test_every_cell_is_a_valid_run_e2e_plan(matrix):
    """Each cell's arguments parse as run_e2e.py's (models, sets, arms all known)."""
    e2e = load_script("run_e2e_for_matrix")
    for name, cell in matrix.CELLS.items():
        args = e2e.parse_args([*cell.args, "--arms", *cell.arms])
        assert [a.name for a in e2e.make_arms(args.arms)] == list(cell.arms), name


def test_two_dry_run_cells_side_by_side(matrix, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names = ["default-llama-3-8b", "kv-fp8-llama-3-8b"]
    rc = matrix.main(["--gpus", "2", "--cells", *names, "--dry-run", "--out", str(tmp_path)])
    assert rc == 0
    got = json.loads((tmp_path / "matrix.json").read_text())
    assert [c["cell"] for c in got["cells"]] == names
    assert sorted(c["gpu"] for c in got["cells"]) == ["0", "1"]
    for c in got["cells"]:
        assert c["rc"] == 0 and "--dry-run" in c["command"]
        assert set(c["arms_status"].values()) == {"dry-run"}
        report = json.loads((tmp_path / c["cell"] / "e2e_results.json").read_text())
        assert report["dry_run"]
    fp8 = json.loads((tmp_path / names[1] / "e2e_results.json").read_text())
    assert fp8["plan"]["kv_cache_dtype"] == "fp8"


def test_an_interrupted_run_stops_its_running_cells(matrix, tmp_path, monkeypatch):
    procs = []

    class Forever(FakeProcess):
        terminated = False

        def poll(self):
            return None

        def terminate(self):
            self.terminated = True

        def wait(self, timeout=None):
            return 0

    def start(cmd, env, log):
        procs.append(Forever(polls=0))
        return procs[-1]

    def interrupt(_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(matrix.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        matrix.run(["default-llama-3-8b", "default-qwen2.5-7b"], tmp_path, ["0", "1"], 3600,
                   start=start)  # fmt: skip
    assert len(procs) == 2 and all(p.terminated for p in procs)

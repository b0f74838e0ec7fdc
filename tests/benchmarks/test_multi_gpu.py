"""`fuselane bench kernels --gpus N`: the sections' assignment to GPUs, the devices each process
is pinned to, the workers' command lines, the refusals, and a whole run under Triton's
interpreter (two processes, merged), all on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuselane.benchmarks.kernels import cli, grid, multi_gpu


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuselane bench")
    cli.add_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["kernels", *argv])


def test_sections_are_shared_out_by_estimated_seconds():
    seconds = multi_gpu.section_seconds("full", grid.FAMILIES, (), ())
    assert list(seconds) == [s for f in grid.FAMILIES for s in grid.SECTIONS[f]]
    for gpus in (1, 2, 3, 4):
        shares = multi_gpu.assign(seconds, gpus)
        assert len(shares) == gpus
        assert sorted(s for share in shares for s in share) == sorted(seconds)
        for share in shares:  # the grid's order inside a share
            assert share == sorted(share, key=list(seconds).index)
        loads = [sum(seconds[s] for s in share) for share in shares]
        # largest first onto the least loaded: no share exceeds the mean by more than the
        # largest section
        assert max(loads) <= sum(loads) / gpus + max(seconds.values())
    two = [sum(seconds[s] for s in share) for share in multi_gpu.assign(seconds, 2)]
    assert abs(two[0] - two[1]) < 0.05 * sum(two)  # the full grid halves evenly
    # more GPUs than sections: one section each, no empty share
    few = {"prefill": 10.0, "mixed": 3.0}
    assert multi_gpu.assign(few, 4) == [["prefill"], ["mixed"]]
    with pytest.raises(ValueError, match="at least 1, got 0"):
        multi_gpu.assign(few, 0)


def test_each_process_gets_one_visible_device():
    assert multi_gpu.visible_devices(3, {}) == ["0", "1", "2"]
    env = {"CUDA_VISIBLE_DEVICES": "4, 6,7"}
    assert multi_gpu.visible_devices(2, env) == ["4", "6"]
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert multi_gpu.visible_devices(2, uuids) == ["GPU-aa", "GPU-bb"]
    with pytest.raises(ValueError, match=r"--gpus 1: CUDA_VISIBLE_DEVICES='' names 0 device"):
        multi_gpu.visible_devices(1, {"CUDA_VISIBLE_DEVICES": ""})


def test_too_few_listed_devices_are_refused_with_the_list():
    with pytest.raises(ValueError, match=r"--gpus 3: CUDA_VISIBLE_DEVICES='4,6' names 2 device"):
        multi_gpu.visible_devices(3, {"CUDA_VISIBLE_DEVICES": "4,6"})


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpus", "2"],
        ["--gpus", "2", "--quick", "--model", "qwen-2.5-7b", "--model", "gemma-2-9b",
         "--peers", "flashinfer,torch", "--budget", "540", "--seed", "3"],
        ["--gpus", "4", "--interpret-smoke", "--peers", "none", "--budget", "0"],
    ],
)  # fmt: skip
def test_a_worker_runs_the_parents_selection_on_its_sections(argv, tmp_path):
    """The worker's command line, parsed by the same parser, is the parent's run with its own
    sections, output folder and one GPU."""
    parent = _args(*argv)
    share = ["decode_fp8", "kv_write"]
    worker = _args(*multi_gpu.worker_argv(parent, share, tmp_path / "gpu1"))
    assert worker.section == share and worker.out == tmp_path / "gpu1" and worker.gpus == 1
    for name in ("model", "quick", "interpret_smoke", "peers", "budget", "seed"):
        assert getattr(worker, name) == getattr(parent, name), name
    assert worker.family is None and worker.baseline is None and worker.no_progress


def test_list_shows_each_process_share():
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.benchmarks.kernels.cli", "--list", "--gpus", "2"],
        capture_output=True, text=True, timeout=120, env=_cpu_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for i, (share, est) in enumerate(multi_gpu.shares("full", grid.FAMILIES, (), (), 2)):
        assert f"--gpus 2, process {i}: {', '.join(share)} (~{est:.0f} s)" in proc.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", "0"], "expected a whole number of at least 1, got '0'"),
        (["--gpus", "two"], "expected a whole number of at least 1, got 'two'"),
        (["--gpus", "2", "--baseline", "b.json"], "--gpus runs no performance gate"),
        (["--gpus", "2"], "--gpus 2: torch sees 0 CUDA GPU(s) on this host"),
    ],
)
def test_refusals(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.benchmarks.kernels.cli", *argv],
        capture_output=True, text=True, timeout=120, env=_cpu_env(),
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def _cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.timeout(240)
def test_two_processes_under_the_interpreter_merge_into_one_report(tmp_path):
    """--interpret-smoke --gpus 2: two benchmark processes, each with its share of the smoke
    grid's sections in its own folder, merged into one report holding every section once."""
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.benchmarks.kernels.cli", "--interpret-smoke",
         "--gpus", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220, env=_cpu_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seconds = multi_gpu.section_seconds("smoke", grid.FAMILIES, (), ())
    shares = multi_gpu.assign(seconds, 2)
    parts = []
    for i, share in enumerate(shares):
        folder = tmp_path / f"gpu{i}"
        assert f"GPU {i}: {', '.join(share)}" in proc.stdout
        assert (folder / "run.log").read_text().strip()
        (part_path,) = folder.glob("kernels-*.json")
        payload = json.loads(part_path.read_text())
        assert {r["section"] for r in payload["results"]} == set(share)
        parts.append(payload)
    (merged_path,) = Path(tmp_path).glob("kernels-*.json")
    merged = json.loads(merged_path.read_text())
    assert [p["file"] for p in merged["parts"]] == [f"gpu{i}/{part_path.name}" for i in range(2)]
    assert merged["failures"] == [] and not merged["skipped"]
    ours = [r for r in merged["results"] if r["impl"] == "fuselane"]
    assert sorted(r["section"] for r in ours) == sorted(seconds)  # each section once
    assert all(r["check_ok"] for r in ours)
    assert len(merged["results"]) == sum(len(p["results"]) for p in parts)
    assert merged_path.with_suffix(".md").read_text().count("## ") >= len(seconds)
    assert "parts:" in proc.stdout

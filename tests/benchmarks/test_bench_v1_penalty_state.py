"""bench_v1_penalty_state.py's plumbing on the CPU (its timings need a GPU)."""

from __future__ import annotations

import json

from fuselane.benchmarks.kernels import bench_v1_penalty_state as bench


def test_cpu_run_writes_every_piece_per_case(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--cpu", "--cases", "2x5,3x1", "--vocab", "300", "--reps", "1", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    (path,) = tmp_path.glob("v1-penalty-state-cpu-*.json")
    result = json.loads(path.read_text())
    assert result["vocab"] == 300 and set(result["cases"]) == {"2x5", "3x1"}
    for times in result["cases"].values():
        assert set(times) == {
            "counts_kept_next_step_ms", "output_state_with_bits_ms",
            "output_state_counts_only_ms", "pack_bin_mask_ms",
            "prompt_mask_ms", "counts_scatter_only_ms", "logits_clone_ms",
            "fused_sample_with_bits_ms", "fused_sample_dense_counts_ms",
        }  # fmt: skip
        assert all(v >= 0 for v in times.values())

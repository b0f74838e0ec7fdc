"""docs/compatibility.md is what benchmarks/compat_matrix.py makes of the committed results,
and the generator writes what a results file records and "not recorded" for the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fuselane.benchmarks import compat_matrix

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_document_is_up_to_date():
    out = subprocess.run(
        [sys.executable, "-m", "fuselane.benchmarks.compat_matrix", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def _results(folder: Path) -> Path:
    """A results folder with one file of each kind the generator reads, and one it does not."""
    folder.mkdir()
    _write(
        folder,
        "triton-matrix-x.json",
        {
            "benchmark": "triton_matrix",
            "device": "GPU-A",
            "baseline": "3.6.0",
            "tolerance": 0.03,
            "versions": [
                {
                    "triton": "3.9.0",
                    "totals": {"passed": 7, "failed": 1},
                    "tests": {compat_matrix.HOPPER_TEST_FILE: {"passed": 2}},
                    "bench": [{}, {}],
                    "outside_tolerance": ["one row"],
                }
            ],
        },
    )
    _write(
        folder,
        "attention-x.json",
        {
            "benchmark": "attention",
            "device": "GPU-B",
            "triton": "3.7.1",
            "notes": ["GOAL PASS decode", "GOAL MISS prefill", "GOAL n/a mixed"],
            "results": [
                {
                    "section": "decode",
                    "case": "B=1 ctx=8 Hq=8 Hkv=2 D=64 page=16",
                    "impl": "fuselane",
                    "decode": "splits=4 ws=True",
                },
                {"section": "decode", "case": "B=1 ctx=8 D=64", "impl": "flashinfer"},
            ],
        },
    )
    log = (
        "fuselane: attention backend CUSTOM for head_size=80, dtype=torch.float16, "
        "kv_cache_dtype=fp8, block_size=None, has_sink=True; fuselane kernels active"
    )
    _write(
        folder,
        "e2e-x.json",
        {
            "schema": "fuselane-e2e/1",
            "device": {"name": "GPU-C"},
            "versions": {"triton": "3.8.0", "vllm": "0.33.0"},
            "plan": {
                "arms": [
                    {"name": "FLASH_ATTN", "env": {"FUSELANE_KERNELS": "none"}},
                    {"name": "fuselane", "env": {"FUSELANE_KERNELS": "attention,kv_cache"}},
                ],
                "engine": {},
                "sampling": {"temperature": 0.5},
            },
            "arms": {"FLASH_ATTN": {}, "fuselane": {"log": {"backend": [log]}}},
            "ratios": {
                "fuselane": {"reference": "FLASH_ATTN", "offline_output_tok_s": {"w": 1.25}}
            },
            "correctness_verdict": {"ok": True},
        },
    )
    _write(folder, "startup-x.json", {"benchmark": "startup"})
    return folder


def _row(text: str, source: str) -> list[str]:
    """The cells of the evidence row of `source` (exactly one is expected; the summary's
    rows, which also end in file names, have five cells)."""
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.endswith(f"| `{source}` |")
    ]
    rows = [cells for cells in rows if len(cells) == len(compat_matrix.COLUMNS) + 3]
    assert len(rows) == 1, rows
    return rows[0]


def test_the_generator_writes_what_each_file_records(tmp_path):
    text = compat_matrix.generate(_results(tmp_path / "results"))
    nr = compat_matrix.NOT_RECORDED

    gpu, triton, vllm, model, kv, head, feats, kernel, checked, _ = _row(
        text, "triton-matrix-x.json"
    )
    assert (gpu, triton, vllm) == ("GPU-A", "3.9.0", compat_matrix.NO_VLLM)
    assert (model, kv, head, feats) == (nr, nr, nr, nr)
    assert kernel == "Triton, Hopper Gluon (2 tests)"
    assert checked == (
        "pytest tests/kernels: 7 passed, 1 failed; 2 benchmark cases, 1 outside ±3% of 3.6.0"
    )

    gpu, triton, _, model, kv, head, feats, kernel, checked, _ = _row(text, "attention-x.json")
    assert (gpu, triton, model, kv, head) == ("GPU-B", "3.7.1", nr, nr, "64")
    assert feats == f"GQA Hq=8 Hkv=2, window / soft cap / sinks {nr}"
    assert kernel == "decode: Hopper Gluon"
    assert checked == "benchmark (attention): 1 fuselane rows timed; goals 1 of 2 met"

    gpu, triton, vllm, model, kv, head, feats, kernel, checked, _ = _row(text, "e2e-x.json")
    assert (gpu, triton, vllm) == ("GPU-C", "3.8.0", "0.33.0")
    assert (model, kv, head) == ("float16", "fp8", "80")
    assert feats.startswith(f"TP {nr}, sinks, sampling: temperature=0.5, vLLM's default runner")
    assert kernel.endswith("vLLM's sampler") and f"Hopper Gluon vs Triton {nr}" in kernel
    assert checked == "e2e: 1.250x FLASH_ATTN output tok/s; greedy verdict PASS"

    assert "- `startup-x.json`" in text
    assert "| Triton | 3.9.0 | `triton-matrix-x.json` |  |  |" in text


def test_check_fails_on_a_stale_document_and_passes_on_a_fresh_one(tmp_path, capsys):
    results = _results(tmp_path / "results")
    doc = tmp_path / "compatibility.md"
    doc.write_text("# hand-kept\n")
    args = ["--results", str(results), "--out", str(doc)]
    assert compat_matrix.main([*args, "--check"]) == 1
    assert "python -m fuselane.benchmarks.compat_matrix" in capsys.readouterr().err
    assert compat_matrix.main(args) == 0
    assert compat_matrix.main([*args, "--check"]) == 0


def test_fuzz_and_backend_test_files_become_test_rows():
    fuzz = {
        "kind": "kernel-fuzz-and-sanitizers",
        "versions": {"triton": "3.9.0"},
        "fuzz": {
            "attention": {
                "device": "GPU-D",
                "families": {
                    "attention": {
                        "seed": 7,
                        "profiles": [
                            {"kv": "fp8", "q_dtype": "float16", "head_size": 256,
                             "window": 128, "softcap": True, "sinks": False},
                            {"kv": "same", "q_dtype": "bfloat16", "head_size": 64,
                             "window": None, "softcap": False, "sinks": True},
                        ],
                        "cases_run": 10, "passed": 8, "mismatched_count": 1, "errors_count": 0,
                        "refused": {"scale": {"count": 1}},
                    }
                },
            }
        },
        "racecheck": {"attention": {"summary": ["RACECHECK SUMMARY: 2 hazards displayed"]}},
    }  # fmt: skip
    (row,) = compat_matrix.rows_for("fuzz-x.json", fuzz)
    assert (row.kind, row.gpu, row.triton, row.vllm) == (
        "tests",
        ("GPU-D",),
        ("3.9.0",),
        (compat_matrix.NO_VLLM,),
    )
    assert row.kv_dtype == ("bfloat16", "fp8_e4m3") and row.head_size == ("64", "256")
    assert set(row.features) == {"window 128", "no window", "soft cap", "no soft cap", "sinks",
                                 "no sinks"}  # fmt: skip
    assert row.checked == (
        "fuzz seed 7: 10 cases, 8 matched the reference, 1 refused as designed, 1 mismatched, "
        "0 errors; compute-sanitizer racecheck: RACECHECK SUMMARY: 2 hazards displayed"
    )

    backend = {
        "kind": "vllm-backend-tests",
        "environment": {"device": "GPU-E", "triton": "3.6.0", "vllm": "0.26.0",
                        "fuselane_kernels": "attention,kv_cache"},
        "models": {"m": {"torch_dtype": "bfloat16", "head_dim": 128, "sliding_window": 512}},
        "fuselane": {"ran": 3, "passed": 2, "failures": [{}],
                     "refused": [{"reasons": "a; b", "tests": ["t1"]},
                                 {"reasons": "b", "tests": ["t2"]}]},
    }  # fmt: skip
    (row,) = compat_matrix.rows_for("backend-x.json", backend)
    assert (row.gpu, row.vllm, row.head_size, row.features) == (
        ("GPU-E",),
        ("0.26.0",),
        ("128",),
        ("window 512",),
    )
    assert row.checked == (
        "vLLM's test_attention_backends.py: 2 of 3 passed, 1 failed, 2 refused through vLLM's "
        "validation (a; b)"
    )

"""Golden outputs of the GPU end-to-end run (`run_e2e.py --golden write|check --golden-file F`).

The offline engines' correctness pass (greedy, settings.correctness_prompts(), the weights
re-initialized from a fixed seed, GOLDEN_OUTPUT tokens with `--golden`, top-5 logprobs) makes the
outputs. `write` keeps the reference arm's (FLASH_ATTN) as the file's reference and the bound
arm's (TRITON_ATTN) beside it; `check` compares the arms of a later run with the file. Either way
every arm that ran is compared with the file's reference by correctness.compare_correctness and
judged by correctness.correctness_verdict, the bound being TRITON_ATTN's own deviation from the
reference (this run's where it ran, else the file's): logprob differences within
TRITON_FACTOR x TRITON_ATTN's (at least LOGPROB_ATOL), greedy divergences only where the
reference's two tokens are within that bound.

The file also records what produced it (SPEC_KEYS: model config, dtype, weights, prompts; then
device and versions). A check whose spec differs stops with both; another device or version is
reported and judged all the same: FLASH_ATTN's own comparison shows how far that moved the
reference.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path
from typing import Any

import settings
from arms import REFERENCE_ARM
from correctness import (
    WEIGHT_SEED,
    WEIGHT_STD,
    compare_correctness,
    correctness_verdict,
)

SCHEMA = "fuselane-e2e-golden/1"
BOUND_ARM = "TRITON_ATTN"
MODES = ("write", "check")
# Generated tokens per prompt in golden mode (the correctness pass's 48 otherwise).
GOLDEN_OUTPUT = 32
# The spec entries that must be equal for a check to mean anything (kv_cache_dtype is in a
# spec only when not "auto", so files written before it existed still check).
SPEC_KEYS = (
    "model_config_sha256",
    "dtype",
    "weights",
    "prompts",
    "output",
    "top_logprobs",
    "kv_cache_dtype",
)


def spec(model: str | Path) -> dict[str, Any]:
    """What the outputs depend on besides the device and versions."""
    config = Path(model) / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None
    kv = {} if settings.KV_CACHE_DTYPE == "auto" else {"kv_cache_dtype": settings.KV_CACHE_DTYPE}
    return {
        "model_config_sha256": digest,
        "model": Path(model).name,
        "dtype": settings.DTYPE,
        "weights": {"load_format": "dummy", "reinit_seed": WEIGHT_SEED, "std": WEIGHT_STD},
        "prompts": {
            "lengths": list(settings.CORRECTNESS_LENGTHS),
            "seed": settings.CORRECTNESS_SEED,
            "id_range": list(settings.PROMPT_ID_RANGE),
            "prompt_logprobs_max_len": settings.CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN,
        },
        "output": settings.CORRECTNESS_OUTPUT,
        "top_logprobs": settings.CORRECTNESS_TOP_LOGPROBS,
        "max_model_len": settings.MAX_MODEL_LEN,
        "tensor_parallel_size": settings.TENSOR_PARALLEL,
        **kv,
    }


def build_file(report: dict[str, Any], model: str | Path) -> dict[str, Any]:
    """The golden file from a run's arms: the reference's and the bound arm's passes."""
    arms = report["arms"]
    missing = [
        a for a in (REFERENCE_ARM, BOUND_ARM) if not (arms.get(a) or {}).get("correctness_raw")
    ]
    if missing:
        raise ValueError(f"no correctness pass of {missing}: both are needed to write the file")
    return {
        "schema": SCHEMA,
        "written_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": report.get("device"),
        "versions": report.get("versions"),
        "spec": spec(model),
        "reference_arm": REFERENCE_ARM,
        "reference": arms[REFERENCE_ARM]["correctness_raw"],
        "bound_arm": BOUND_ARM,
        "bound": arms[BOUND_ARM]["correctness_raw"],
    }


def judge(golden: dict[str, Any], arms: dict[str, Any]) -> dict[str, Any]:
    """Every arm with a correctness pass against the file's reference, and its verdict; an arm
    of the run without a pass (it failed, or the budget skipped it) fails the result, except the
    bound arm, whose deviation the file also holds."""
    ref = golden["reference"]
    missing = [
        name
        for name, res in arms.items()
        if name != BOUND_ARM and not (res or {}).get("correctness_raw")
    ]
    comparisons = {
        name: compare_correctness(ref, res["correctness_raw"])
        for name, res in arms.items()
        if (res or {}).get("correctness_raw") is not None
    }
    live = BOUND_ARM in comparisons
    bound = comparisons[BOUND_ARM] if live else compare_correctness(ref, golden["bound"])
    verdicts = {
        name: correctness_verdict(c, bound) for name, c in comparisons.items() if name != BOUND_ARM
    }
    return {
        "bound_source": "this run" if live else "the file",
        "bound_comparison": bound,
        "comparisons": comparisons,
        "verdicts": verdicts,
        "without_pass": missing,
        "ok": bool(verdicts) and not missing and all(v["ok"] for v in verdicts.values()),
    }


def spec_differences(golden: dict[str, Any], now: dict[str, Any]) -> list[str]:
    was = golden.get("spec") or {}
    return [
        f"{k}: file {was.get(k)!r}, this run {now.get(k)!r}"
        for k in SPEC_KEYS
        if was.get(k) != now.get(k)
    ]


def run(mode: str, path: Path, report: dict[str, Any], model: str | Path) -> dict[str, Any]:
    """`--golden write|check`: write the file from this run, or read it; then judge every arm
    against it. The result (the verdicts and their inputs) goes into the report."""
    out: dict[str, Any] = {"mode": mode, "file": str(path)}
    try:
        golden = _write(path, report, model) if mode == "write" else _read(path, model)
        out["file_written_at"] = golden.get("written_at")
        out["changed_since_file"] = {
            k: {"file": golden.get(k), "this run": report.get(k)}
            for k in ("device", "versions")
            if golden.get(k) != report.get(k)
        }
        out.update(judge(golden, report["arms"]))
    except Exception as e:  # noqa: BLE001 - recorded; the run's other results stand
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    return out


def _write(path: Path, report: dict[str, Any], model: str | Path) -> dict[str, Any]:
    golden = build_file(report, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, indent=1) + "\n")
    return golden


def _read(path: Path, model: str | Path) -> dict[str, Any]:
    golden = json.loads(path.read_text())
    if golden.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {golden.get('schema')!r}, expected {SCHEMA!r}")
    differences = spec_differences(golden, spec(model))
    if differences:
        raise ValueError("the file was written for other inputs: " + "; ".join(differences))
    return golden


def lines(result: dict[str, Any] | None) -> list[str]:
    """The table's lines for a golden result."""
    if not result:
        return []
    head = f"golden {result['mode']} {result['file']}"
    if "error" in result:
        return [f"{head}: FAILED ({result['error']})"]
    out = [f"{head} (bound: TRITON_ATTN from {result['bound_source']})"]
    for name, v in result["verdicts"].items():
        c = result["comparisons"][name]
        gen = v["checks"]["max_abs_logprob_diff_generated"]
        out.append(
            f"  {name}: {'PASS' if v['ok'] else 'FAIL'}, identical "
            f"{c['prompts_identical']}/{c['prompts']}, max |dlogprob| generated "
            f"{_f(gen['value'])} (bound {_f(gen['bound'])}), divergences beyond tolerance "
            f"{v['checks']['divergences_beyond_tolerance']['value']}"
        )
    if result.get("without_pass"):
        out.append(f"  FAIL: no correctness pass from {', '.join(result['without_pass'])}")
    if result.get("changed_since_file"):
        out.append(f"  changed since the file: {', '.join(result['changed_since_file'])}")
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"

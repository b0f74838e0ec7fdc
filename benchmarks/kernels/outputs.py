"""What `fuselane bench kernels` writes: the JSON, a markdown report and PNG plots.

All three are made from the JSON payload alone (`results` rows as `harness.Report.as_dicts`
gives them), so the report and the plots of a committed JSON can be made again from it, and the
parts of a full grid run over several GPU calls can be joined into one (`merge`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuselane.benchmarks.kernels.grid import FAMILIES, PREFILL_SECTIONS, SECTIONS

Payload = dict[str, Any]
FLOP_SECTIONS = (*PREFILL_SECTIONS, "mixed")  # timed against the GEMM ceiling; the rest copy


def stem(payload: Payload) -> str:
    dev = str(payload["device"]).replace("NVIDIA ", "").split(" (")[0]
    return f"kernels-{dev.replace(' ', '-').lower()}-{payload['date']}"


def write_all(payload: Payload, out_dir: Path) -> dict[str, Path]:
    """JSON, markdown and (with matplotlib) one PNG per family; returns the paths by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = stem(payload)
    paths = {"json": out_dir / f"{base}.json", "markdown": out_dir / f"{base}.md"}
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown(payload))
    for family, path in plots(payload, out_dir, base).items():
        paths[f"png:{family}"] = path
    return paths


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------


def _us(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _impls(rows: Sequence[dict]) -> list[str]:
    """Peers of a section in first-seen order (fuselane is the row itself)."""
    return list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "fuselane"))


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    text = _us(row["us"])
    if "peer_over_fuselane" in row:
        text += f" ({row['peer_over_fuselane']:.2f}x)"
    if row.get("check_ok") is False:
        text += " †"
    return text


def _best(case_rows: dict[str, dict]) -> str:
    """The fastest peer whose output matched the reference: `name (peer / fuselane)` (fuselane's
    own other kernels, `fuselane-*`, are not peers)."""
    ok = [
        r
        for name, r in case_rows.items()
        if not name.startswith("fuselane") and r.get("check_ok", True)
    ]
    if not ok:
        return "-"
    best = min(ok, key=lambda r: r["us"])
    ratio = best.get("peer_over_fuselane")
    return best["impl"] + (f" ({ratio:.2f}x)" if ratio is not None else "")


def section_table(rows: Sequence[dict], flops: bool) -> list[str]:
    peers = _impls(rows)
    rate, pct = ("TFLOP/s", "% of GEMM") if flops else ("TB/s", "% of copy")
    head = ["models", "case", "fuselane µs", rate, pct, *peers]
    if peers:
        head.append("best peer")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys(r["case"] for r in rows):
        case_rows = {r["impl"]: r for r in rows if r["case"] == key}
        first = next(iter(case_rows.values()))
        ours = case_rows.get("fuselane")
        cells = [first["models"], first["label"]]
        if ours is None:
            cells += ["not timed", "", ""]
        else:
            value = ours.get("TFLOPs" if flops else "TBps")
            share = ours.get("pct_gemm_ceiling" if flops else "pct_copy_ceiling")
            cells += [_us(ours["us"]), "" if value is None else f"{value:g}",
                      "" if share is None else f"{share:g}"]  # fmt: skip
        cells += [_cell(case_rows.get(p)) for p in peers]
        if peers:
            cells.append(_best(case_rows))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def markdown(payload: Payload) -> str:
    c = payload.get("ceilings", {})
    info = [str(payload["device"])]
    if payload.get("capability"):
        info.append(f"compute {payload['capability']}, {payload['sm_count']} SMs")
    info += [f"torch {payload['torch']}", f"Triton {payload['triton']}"]
    if payload.get("cuda"):
        info.append(f"CUDA {payload['cuda']}")
    info += [str(payload["date"]), f"grid `{payload['grid']}`", f"{payload['elapsed_s']:.0f} s"]
    ceilings = []
    if "copy_tbps" in c:
        ceilings.append(f"copy {c['copy_tbps']:g} TB/s (read + write)")
    if "gemm_tflops" in c:
        ceilings.append(f"bf16 GEMM {c['gemm_tflops']:g} TFLOP/s")
    if "empty_kernel_us" in c:
        ceilings.append(f"empty Triton kernel {c['empty_kernel_us']:g} µs")
    out = ["# fuselane kernel benchmark", ""]
    if payload.get("interpret"):
        out += ["**Interpreter smoke run: a plumbing check, the timings are meaningless.**", ""]
    out += [
        " · ".join(info),
        "",
        f"Ceilings measured in this run: {', '.join(ceilings) or 'none'}.",
        "Peers: " + ", ".join(f"{k} {v}" for k, v in payload.get("peers", {}).items()) + ".",
        (
            "Times: one call each under the interpreter. "
            if payload.get("interpret")
            else "Times: medians of CUDA-graph replays, µs per call. "
        )
        + "Peer columns: µs (peer time / fuselane time; > 1: fuselane is faster); † the "
        "output differs from the reference (see the notes).",
        "",
        "| model | Hq / Hkv / D | vocab | |",
        "|---|---|---|---|",
    ]
    for name, m in payload.get("models", {}).items():
        heads = f"{m['num_q_heads']} / {m['num_kv_heads']} / {m['head_size']}"
        extra = [f"window {m['sliding_window']}"] if m.get("sliding_window") else []
        extra += [f"soft cap {m['softcap']:g}"] if m.get("softcap") else []
        extra += [m["note"]] if m.get("note") else []
        out.append(f"| {name} | {heads} | {m['vocab']} | {'; '.join(extra)} |")
    results = payload.get("results", [])
    for family in FAMILIES:
        for section in SECTIONS[family]:
            rows = [r for r in results if r["section"] == section]
            if rows:
                out += ["", f"## {family}: {section}", ""]
                out += section_table(rows, section in FLOP_SECTIONS)
    for title, key in (("Failures", "failures"), ("Skipped", "skipped"), ("Notes", "notes")):
        if payload.get(key):
            out += ["", f"## {title}", ""] + [f"- {line}" for line in payload[key]]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------
# Joining the parts of one grid
# ----------------------------------------------------------------------------------------------


def merge(parts: Sequence[Payload], names: Sequence[str]) -> Payload:
    """One payload of several runs on one GPU model (the parts of a split full grid): their
    rows (a row measured twice: the later part's, noted), failures, skipped cases and notes;
    each part's run facts (ceilings, elapsed, selection) under `parts`. The rows keep the
    ceiling shares and ratios of the run that measured them."""
    devices = {str(p["device"]) for p in parts}
    if len(devices) != 1:
        raise ValueError(f"parts of different GPU models: {', '.join(sorted(devices))}")
    rows: dict[tuple[str, str, str], dict] = {}
    notes: list[str] = []
    for name, part in zip(names, parts, strict=True):
        for r in part.get("results", []):
            key = (r["section"], r["case"], r["impl"])
            if key in rows:
                notes.append(f"{' | '.join(key)}: measured again in {name}, that row kept")
            rows[key] = r
    first = parts[0]
    merged = {k: v for k, v in first.items() if k not in ("results", "failures", "skipped")}
    facts = ("grid", "families", "sections", "budget_s", "elapsed_s", "ceilings", "date")
    merged.update(
        date=max(str(p["date"]) for p in parts),
        families=list(dict.fromkeys(f for p in parts for f in p.get("families", []))),
        sections="merged",
        models={k: v for p in parts for k, v in p.get("models", {}).items()},
        elapsed_s=round(sum(float(p.get("elapsed_s", 0)) for p in parts), 1),
        failures=[f for p in parts for f in p.get("failures", [])],
        skipped=[s for p in parts for s in p.get("skipped", [])],
        notes=[n for p in parts for n in p.get("notes", [])] + notes,
        parts=[f for n, p in zip(names, parts, strict=True) for f in _part_facts(n, p, facts)],
        results=list(rows.values()),
    )
    return merged


def _part_facts(name: str, payload: Payload, facts: Sequence[str]) -> list[dict]:
    """The run facts of one part, or of each of its own parts when it is itself a merge (a
    `--gpus` run merged again with another): `name: inner file`."""
    inner = payload.get("parts")
    if inner:
        return [{**p, "file": f"{name}: {p['file']}"} for p in inner]
    return [{"file": name, **{k: payload.get(k) for k in facts}}]


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def plots(payload: Payload, out_dir: Path, base: str) -> dict[str, Path]:
    """One PNG per family: time against size per section (rows) and model (columns), with the
    roofline of the run's measured ceilings. Empty when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    results = payload.get("results", [])
    ceilings = payload.get("ceilings", {})
    paths = {}
    for family in FAMILIES:
        sections = [s for s in SECTIONS[family] if any(r["section"] == s for r in results)]
        if not sections:
            continue
        models = list(dict.fromkeys(r["models"] for r in results if r["section"] in sections))
        fig, axes = plt.subplots(
            len(sections), len(models), figsize=(4.2 * len(models), 3.4 * len(sections)),
            squeeze=False,
        )  # fmt: skip
        for i, section in enumerate(sections):
            for j, model in enumerate(models):
                rows = [r for r in results if r["section"] == section and r["models"] == model]
                _panel(axes[i][j], rows, section, model, ceilings)
        fig.suptitle(f"fuselane {family}: {payload['device']}", fontsize=11)
        fig.tight_layout()
        path = out_dir / f"{base}-{family}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[family] = path
    return paths


def _panel(ax: Any, rows: Sequence[dict], section: str, model: str, ceilings: dict) -> None:
    flops = section in FLOP_SECTIONS
    size_key = "flops" if flops else "nbytes"
    ax.set_title(f"{section}: {model}", fontsize=8)
    rows = [r for r in rows if r.get(size_key)]
    if not rows:
        ax.set_axis_off()
        return
    for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = sorted((r[size_key], r["us"]) for r in rows if r["impl"] == impl)
        ours = impl == "fuselane"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                linewidth=2.0 if ours else 1.0, linestyle="-" if ours else "--",
                label=impl[:40])  # fmt: skip
    rate = ceilings.get("gemm_tflops" if flops else "copy_tbps")
    if rate:
        lo = min(r[size_key] for r in rows) / 1.5
        hi = max(r[size_key] for r in rows) * 1.5
        xs = [lo * (hi / lo) ** (k / 32) for k in range(33)]
        floor = ceilings.get("empty_kernel_us", 0.0)
        ys = [max(x / (rate * 1e12) * 1e6, floor) for x in xs]
        unit = "TFLOP/s" if flops else "TB/s"
        ax.plot(xs, ys, color="black", linewidth=0.8, label=f"roofline ({rate:g} {unit})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per call" if flops else "bytes moved per call", fontsize=7)
    ax.set_ylabel("µs per call", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    ax.legend(fontsize=5)

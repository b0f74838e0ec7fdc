"""Makes `fuselane.*` importable for a benchmark script run as a file from a source checkout.

`python3 benchmarks/kernels/bench_attention.py` works on a GPU machine whose checkout is not
installed: pyproject.toml's package-dir maps `fuselane.<x>` to the root folder `<x>`, so where no
installed `fuselane` imports, a namespace package over the checkout's root stands in for it and
every module then imports under the one name it has when installed (no second copy of a module
under a bare name). A script imports this only when it runs as a file (`if not __package__:`),
when this folder is first on sys.path; `python -m fuselane.benchmarks.kernels.<script>` needs
none of it.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_fuselane() -> None:
    """An installed `fuselane` if there is one, else the checkout's root folders as it."""
    try:
        import fuselane.benchmarks  # noqa: F401 - an installed checkout (pip install -e .)
    except ImportError:
        package = types.ModuleType("fuselane")
        package.__path__ = [str(ROOT)]
        sys.modules["fuselane"] = package


import_fuselane()

"""A short, machine-independent hash of the kernel sources.

CHANGELOG.md records it (`Kernel sources: <hash>` in its newest section) and
tests/test_changelog.py compares, so a change under kernels/ cannot land without a change-log
entry. The hash covers every `*.py` file under this package, found from this module's own
location: for each file, sorted by its POSIX path relative to the package, the path, a NUL
byte and the file's bytes go into one sha256. No timestamps, permissions or `__pycache__`
enter it, so every checkout of the same sources gives the same hash. Standard library only,
so that reading it imports neither torch nor Triton.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

# The kernels package directory: the folder this module lives in.
KERNELS_DIR = Path(__file__).resolve().parent
# Hex digits kept: 48 bits, enough to tell two versions of the sources apart by eye and by test.
HASH_LENGTH = 12


def kernel_sources(root: Path) -> list[Path]:
    """The `*.py` files under `root`, sorted by their POSIX path relative to it; compiled
    caches are left out (they differ between Python versions, not between sources)."""
    files = (p for p in root.rglob("*.py") if "__pycache__" not in p.relative_to(root).parts)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _hash_tree(root: Path) -> str:
    digest = hashlib.sha256()
    for path in kernel_sources(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:HASH_LENGTH]


@functools.cache
def _installed_hash() -> str:
    # The sources of a running process do not change under it: hash them once.
    return _hash_tree(KERNELS_DIR)


def kernel_source_hash(root: Path | str | None = None) -> str:
    """12 hex digits of sha256 over the kernel sources (see the module docstring).

    root: another copy of the kernels folder to hash (the tests pass an edited copy); by
    default this package's own folder, hashed once per process.
    """
    if root is None:
        return _installed_hash()
    return _hash_tree(Path(root))

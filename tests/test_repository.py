"""The repository stands alone: nothing in it points at folders, design notes or trackers
outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Text that names something a reader of the repository cannot open.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|\.notes/|\bissue[ -]?#?\d+\b", re.IGNORECASE)
TEXT = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".txt", ""}


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / p for p in out.splitlines() if Path(p).suffix in TEXT]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in _tracked():
        if not path.is_file() or path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert hits == []


def test_the_pattern_catches_what_it_is_for():
    for text in ("see ../shared/anchors", "DESIGN.md habit 5", ".notes/gpu.log", "(issue 5)"):
        assert OUTSIDE.search(text), text
    assert not OUTSIDE.search("the scheduler's issue slots; issue rate")

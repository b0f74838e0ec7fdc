"""The change log keeps up with the kernels: its newest section records the hash of the kernel
sources (kernels/build_id.py), and every results file it cites exists."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fuselane.kernels.build_id import KERNELS_DIR, kernel_source_hash

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
RECORDED = re.compile(r"^Kernel sources: `?([0-9a-f]{12})`?\s*$", re.MULTILINE)


def _newest_section(text: str) -> str:
    """The text of the first `## ` section: [Unreleased], or the newest release."""
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert len(sections) > 1, "CHANGELOG.md has no `## ` section"
    return sections[1]


def _copy_kernels(tmp_path: Path) -> Path:
    copy = tmp_path / "repo" / "kernels"
    shutil.copytree(KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_newest_changelog_section_records_the_kernel_source_hash():
    section = _newest_section(CHANGELOG.read_text())
    found = RECORDED.findall(section)
    current = kernel_source_hash()
    assert found, (
        "CHANGELOG.md's newest section has no `Kernel sources: <hash>` line; "
        f"the kernel sources' hash is {current}"
    )
    assert found[0] == current, (
        f"kernels/ changed: CHANGELOG.md records kernel sources {found[0]}, the sources give "
        f"{current}. A change to kernels/ needs a change-log entry under the family it changed "
        "(Attention, KV cache, Sampling, Launch path or Stack in [Unreleased]: what changed, its "
        "effect, the results file that measured it); then update the recorded hash to "
        f"`Kernel sources: `{current}``."
    )


def test_every_results_file_the_changelog_cites_exists():
    cited = set(re.findall(r"[\w.-]+\.json", CHANGELOG.read_text()))
    assert cited, "the change log cites no results file"
    missing = sorted(n for n in cited if not (ROOT / "benchmarks" / "results" / n).is_file())
    assert missing == [], f"CHANGELOG.md cites results files that do not exist: {missing}"


def test_the_hash_is_twelve_hex_digits_of_this_package():
    digest = kernel_source_hash()
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    assert kernel_source_hash(KERNELS_DIR) == digest


def test_the_hash_follows_a_kernel_file_and_nothing_else(tmp_path):
    copy = _copy_kernels(tmp_path)
    before = kernel_source_hash(copy)
    assert before == kernel_source_hash(), "a copy of the sources hashes as the sources"

    # Not sources: compiled caches, timestamps, and files outside the kernels folder.
    (copy / "attention" / "__pycache__").mkdir()
    (copy / "attention" / "__pycache__" / "plan.cpython-311.pyc").write_bytes(b"\0compiled")
    os.utime(copy / "attention" / "plan.py", (0, 0))
    (copy.parent / "plugin").mkdir()
    (copy.parent / "plugin" / "backend.py").write_text("x = 1\n")
    (copy.parent / "README.md").write_text("unrelated\n")
    assert kernel_source_hash(copy) == before

    plan = copy / "attention" / "plan.py"
    plan.write_text(plan.read_text() + "\n# one more line\n")
    edited = kernel_source_hash(copy)
    assert edited != before

    (copy / "sampling" / "extra.py").write_text("")
    assert kernel_source_hash(copy) not in (before, edited), "a new kernel module counts too"

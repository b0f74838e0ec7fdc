"""The README's opening commands are what a new user and CI run: keep them honest."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert block, "README.md has no code block"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]


def test_readme_opens_with_exactly_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_fence = next(i for i, ln in enumerate(lines) if ln.startswith("```"))
    assert first_fence <= 3, "the two set-up commands must open the README"
    cmds = _first_block()
    assert len(cmds) == 2, cmds
    main_job, tests = cmds
    assert "fuselane" in main_job and "pytest" not in main_job
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run takes the command from the README's first block; the selection must find it.
    assert "awk '/^```/{n++; next} n==1 && /pytest/' README.md" in ci
    assert 'rc" -eq 5' in ci  # pytest's "no tests collected" is handled

"""`fuselane dashboards [--out DIR] [--check]`: write the Grafana dashboards, or check them.

`add_parser(subparsers)` adds the command to the `fuselane` parser (serving/cli.py). The SDK
is imported by the command only, so the rest of the CLI works without the `dashboards` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("grafana") / "dashboards"
REGENERATE = "fuselane dashboards"


def generate() -> dict[str, str]:
    """{file name: JSON text} of every dashboard, as committed."""
    from . import build_all
    from .common import render

    return {name: render(model) for name, model in build_all().items()}


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate().items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def stale(out: Path) -> list[str]:
    """One line per dashboard file under `out` that differs from the generator's output."""
    problems = []
    for name, text in generate().items():
        path = out / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: stale (differs from the generator's output)")
    return problems


def _cmd(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        if args.check:
            problems = stale(out)
            for line in problems:
                print(f"fuselane dashboards: {line}", file=sys.stderr)
            if problems:
                print(f"regenerate with `{REGENERATE} --out {out}`", file=sys.stderr)
                return 1
            print(f"{out}: dashboards are current")
            return 0
        for path in write(out):
            print(f"wrote {path}")
        return 0
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("grafana_foundation_sdk"):
            print(
                "fuselane dashboards: the Grafana Foundation SDK is missing: "
                "pip install 'fuselane[dashboards]'",
                file=sys.stderr,
            )
            return 2
        raise


def add_parser(subparsers: Any) -> None:
    """Add `dashboards` to the `fuselane` subcommands."""
    p = subparsers.add_parser(
        "dashboards",
        help="write the Grafana dashboards (kernels, canary) as JSON, or check them",
        description="Generates fuselane's Grafana dashboards from their definitions "
        "(serving/dashboards/) into a folder; --check compares instead and exits 1 naming "
        "every stale or missing file.",
    )
    p.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help=f"folder of the dashboard JSON files (default: {DEFAULT_OUT})",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file is missing or differs from the generator's output",
    )
    p.set_defaults(func=_cmd)

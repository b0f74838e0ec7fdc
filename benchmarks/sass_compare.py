"""Whether two Triton caches hold the same machine code: the check that a refactor of the host
code (or of where a kernel's source lives) changed no compiled kernel.

    python -m fuselane.benchmarks.sass_compare BEFORE_CACHE AFTER_CACHE --out FILE.json

Run the same workload twice, each with its own `TRITON_CACHE_DIR` (the code before and after
the change), then compare: every cubin's SASS (`cuobjdump -sass`, Triton's own copy) is hashed
and grouped by kernel name. The SASS listing has no line information, so a kernel whose source
moved to another file, or to other lines, lists the same. The verdict is "identical" when each
kernel name holds the same multiset of SASS hashes in both caches; the JSON names every kernel
with variants present on one side only.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def cuobjdump() -> str:
    """Triton's bundled cuobjdump (the one matching the ptxas that built the cubins)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else "cuobjdump"


def sass_of(cubin: Path, tool: str) -> str:
    """The SASS listing of one cubin, without the header lines that name the file."""
    text = subprocess.run(
        [tool, "-sass", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    return "\n".join(
        line for line in text.splitlines() if line.strip() and not line.startswith("Fatbin")
    )


def variants(cache: Path, tool: str) -> dict[str, list[str]]:
    """Kernel name -> sorted SASS hashes of its compiled variants in a Triton cache."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for cubin in sorted(cache.rglob("*.cubin")):
        digest = hashlib.sha256(sass_of(cubin, tool).encode()).hexdigest()[:16]
        found[cubin.stem].append(digest)
    return {name: sorted(hashes) for name, hashes in sorted(found.items())}


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, Any]:
    """Per kernel: variant counts and the hashes on one side only; the overall verdict."""
    kernels = {}
    for name in sorted(set(before) | set(after)):
        b = collections.Counter(before.get(name, []))
        a = collections.Counter(after.get(name, []))
        kernels[name] = {
            "before": sum(b.values()),
            "after": sum(a.values()),
            "only_before": sorted((b - a).elements()),
            "only_after": sorted((a - b).elements()),
        }
    same = all(not k["only_before"] and not k["only_after"] for k in kernels.values())
    return {"verdict": "identical" if same else "different", "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path, help="TRITON_CACHE_DIR of the run before the change")
    p.add_argument("after", type=Path, help="TRITON_CACHE_DIR of the run after the change")
    p.add_argument("--out", type=Path, help="write the comparison here (JSON)")
    p.add_argument("--label", default="", help="what was run (recorded in the JSON)")
    args = p.parse_args(argv)
    tool = cuobjdump()
    result = {
        "benchmark": "sass_compare",
        "date": dt.date.today().isoformat(),
        "label": args.label,
        "device": os.environ.get("FUSELANE_DEVICE_NAME", ""),
        **compare(variants(args.before, tool), variants(args.after, tool)),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    counts = {n: (k["before"], k["after"]) for n, k in result["kernels"].items()}
    print(f"{result['verdict']}: {counts}")
    return 0 if result["verdict"] == "identical" else 1


if __name__ == "__main__":
    sys.exit(main())

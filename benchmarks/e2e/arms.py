"""The arms of the end-to-end run: which engine configurations there are, which one each is
compared with, and what an arm's engines get (the offline engine's `vllm.LLM` arguments, the
server's command line, the environment of both).

An arm is vLLM's `attention_backend` (None: vLLM and fuselane choose) plus the environment its
engine processes get on top of the run's: FLASH_ATTN (the Hopper default, the reference),
fuselane (`FUSELANE_KERNELS=attention,kv_cache`), fuselane_all (`FUSELANE_KERNELS=all`, once
`fuselane.plugin.sampler_hook` exists), TRITON_ATTN, and the V1-runner pair named with --arms.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import settings

REFERENCE_ARM = "FLASH_ATTN"
# Servers start after every arm's offline engine, in this order, while the budget lasts (8 engine
# starts do not fit in 9 minutes at ~45-65 s each): the online goal compares fuselane with
# FLASH_ATTN.
ONLINE_PRIORITY = (
    "FLASH_ATTN",
    "fuselane",
    "TRITON_ATTN",
    "fuselane_all",
    "FLASH_ATTN_v1",
    "fuselane_all_v1",
    "fuselane_triton",
)


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


def triton_top_k_top_p_rows(source: str) -> int | None:
    """From the source of vLLM's sampler ops (vllm/v1/sample/ops/topk_topp_sampler.py): the
    batch size from which `apply_top_k_top_p` masks top-k / top-p with vLLM's Triton kernel
    rather than a torch sort, where Triton is there (0.26: 8 rows; 0.32 / 0.33: every batch,
    1); None where the source says neither."""
    body = source.split("def apply_top_k_top_p(", 1)[-1].split("\ndef ", 1)[0]
    m = re.search(r"HAS_TRITON and logits\.shape\[0\]\s*>=\s*(\d+)", body)
    if m:
        return int(m.group(1))
    if re.search(r"if HAS_TRITON:\s*\n\s*return apply_top_k_top_p_triton\(", body):
        return 1
    return None


def stock_sampler() -> dict[str, Any]:
    """What vLLM's own sampler runs in the stock arms on this install, read from the installed
    vLLM's sources (not imported) and the arms' environment. Both runners mask top-k / top-p
    with `apply_top_k_top_p`: vLLM's Triton kernel from `triton_from_rows` rows on (Triton is
    there on a GPU), a torch sort below. The V1 runner then draws in
    `TopKTopPSampler.forward_native` (softmax, exponential noise from torch generators;
    FlashInfer's sampler only with VLLM_USE_FLASHINFER_SAMPLER=1, which the arms set to 0),
    the V2 runner with its Gumbel kernel (vllm/v1/worker/gpu/sample/gumbel.py)."""
    flashinfer = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0") == "1"
    out: dict[str, Any] = {"flashinfer_sampler": flashinfer}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        out["error"] = "vllm is not installed"
        return out
    root = Path(next(iter(spec.submodule_search_locations)))
    ops = root / "v1" / "sample" / "ops" / "topk_topp_sampler.py"
    out["triton_from_rows"] = triton_top_k_top_p_rows(ops.read_text()) if ops.exists() else None
    out["v1"] = "TopKTopPSampler." + (
        "forward_cuda (FlashInfer)" if flashinfer else "forward_native"
    )
    out["v2_gumbel"] = (root / "v1" / "worker" / "gpu" / "sample" / "gumbel.py").exists()
    return out


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
        known = {a.name: a for a in arms + v1_runner_arms() + triage_arms()}
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


# Named with --arms only: fuselane with its Hopper kernels off (FUSELANE_HOPPER_KERNELS=0, the
# operator switch), the Triton kernels at every shape, to tell what the Hopper kernels change in
# an engine (a model's throughput or its correctness deviation) from what the Triton ones do.
def triage_arms() -> list[Arm]:
    env = {"FUSELANE_KERNELS": "attention,kv_cache", "FUSELANE_HOPPER_KERNELS": "0"}
    return [Arm("fuselane_triton", None, env, needs_fuselane=True)]


def every_arm() -> list[Arm]:
    """Every arm a run can name, once each."""
    return make_arms(with_all=True) + v1_runner_arms() + triage_arms()


def reference_of(name: str) -> str:
    return REFERENCE_OF.get(name, REFERENCE_ARM)


def is_reference(name: str) -> bool:
    """An arm the others are compared with (no ratios or comparison of its own)."""
    return name == REFERENCE_ARM or name in REFERENCE_OF.values()


def compile_cache_dir(arm: Arm) -> Path:
    return settings.WORK_DIR / "compile" / arm.name


def trace_dir(arm: Arm) -> Path:
    return settings.WORK_DIR / "traces" / arm.name


def engine_kwargs(arm: Arm, model: str | Path, profile: bool = False) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments of an arm (vLLM 0.26 spelling); `profile`: vLLM's torch
    profiler configured (started only around the probe's profiled requests)."""
    kw: dict[str, Any] = {
        "model": str(model),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": settings.DTYPE,
        "max_model_len": settings.MAX_MODEL_LEN,
        "gpu_memory_utilization": settings.GPU_MEMORY_UTILIZATION,
        "seed": settings.ENGINE_SEED,
        "compilation_config": {"cache_dir": str(compile_cache_dir(arm))},
    }
    if settings.TENSOR_PARALLEL > 1:
        kw["tensor_parallel_size"] = settings.TENSOR_PARALLEL
    if settings.KV_CACHE_DTYPE != "auto":  # --kv-cache-dtype: every arm alike
        kw["kv_cache_dtype"] = settings.KV_CACHE_DTYPE
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
    # One flag and its value a line (the formatter would put each on a line of its own).
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "llama8b",
        "--load-format", "dummy", "--dtype", settings.DTYPE,
        "--max-model-len", str(settings.MAX_MODEL_LEN),
        "--gpu-memory-utilization", str(settings.GPU_MEMORY_UTILIZATION),
        "--seed", str(settings.ENGINE_SEED),
        "--compilation-config", json.dumps({"cache_dir": str(compile_cache_dir(arm))}),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if settings.TENSOR_PARALLEL > 1:
        cmd += ["--tensor-parallel-size", str(settings.TENSOR_PARALLEL)]
    if settings.KV_CACHE_DTYPE != "auto":
        cmd += ["--kv-cache-dtype", settings.KV_CACHE_DTYPE]
    if arm.attention_backend is not None:
        cmd += ["--attention-backend", arm.attention_backend]
    return cmd


def arm_env(arm: Arm) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not staged
    env.pop("VLLM_ATTENTION_BACKEND", None)  # 0.26 takes attention_backend= / the flag
    env.update(arm.env)
    env["PYTHONUNBUFFERED"] = "1"
    # LLM.collective_rpc(reinit_weights) sends a function to the engine's worker process.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def server_env(arm: Arm) -> dict[str, str]:
    """The server's environment: the arm's, plus with --telemetry for a fuselane arm the kernel
    metrics of every engine process on `/metrics` (a fresh multiprocess directory)."""
    env = arm_env(arm)
    if settings.TELEMETRY and arm.needs_fuselane:
        prom = settings.WORK_DIR / "prometheus" / arm.name
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir(parents=True)
        env.update(FUSELANE_TELEMETRY="1", PROMETHEUS_MULTIPROC_DIR=str(prom))
    return env

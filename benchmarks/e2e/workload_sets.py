"""What one run measures: the model folder (`--model`), the workload set (`--workloads`), the KV
cache dtype (`--kv-cache-dtype`), and the engine shape they give.

Sets (each one GPU call; docs/notes/e2e.md has the command of each):

- `default`: the three workloads of settings.WORKLOADS, sampling T=0.8 / k=50 / p=0.9, servers;
- `sampling`: 512 x (128 in, 512 out) with T=0.8, top-k 50, top-p 0.95, repetition penalty 1.1
  on every arm: short prompts, long outputs, a 512-row batch, so the sampler's share of a step
  is large; arms FLASH_ATTN_v1 and fuselane_all_v1 unless `--arms` says otherwise (vLLM 0.26's
  V2 runner keeps its own sampler, so stock vs `FUSELANE_KERNELS=all` is compared on V1);
- `long-prompts`: 8 x (16,384 in, 128 out), prefill-bound;
- `long-decode`: N x (32,768 in, 1,024 out), decode over long contexts; N from
  `--long-decode-requests` or `long_decode_requests()` (16, or 8 below 100 GiB of GPU memory).

The non-default sets run offline engines only (the servers' load has the default set's shape).
`plan_shape` turns a set, the model's config and the dtype into a `RunShape` (pure: the tests
call it); `apply_shape` writes it into `settings`, where every module reads it at call time.
The engine's max_model_len is the longest request plus headroom, capped at the model's
`max_position_embeddings` (vLLM refuses more): requests that no longer fit are shortened and the
plan says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import settings
from settings import Workload

MODELS_DIR = Path(__file__).resolve().parent / "models"
# The folder the earlier GPU runs used (same config.json bytes: models/README.md).
DEFAULT_MODEL_NAME = "llama-3-8b"
SET_NAMES = ("default", "sampling", "long-prompts", "long-decode")
# vLLM 0.26's values that fuselane's backend (plugin/kv_write.py SUPPORTED_KV_CACHE_DTYPES) and
# FLASH_ATTN (FA3 on Hopper) both take; "fp8" means e4m3 on CUDA.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Room above the longest request, as the default's 8704 = 8192 + 256 + 256.
HEADROOM = 256
# long-decode: Llama-3-8B's bf16 KV is 128 KiB a token, so 16 x 33,792 tokens need 66 GiB:
# more than 0.85 x 80 GB less 15 GiB of weights (an H100 keeps ~11 requests resident, and
# the rest would wait), while 8 (33 GiB) fit; an H200's 141 GB holds 16.
LONG_DECODE_BIG_GPU_GIB = 100.0
LONG_DECODE_REQUESTS = (16, 8)  # at or above LONG_DECODE_BIG_GPU_GIB, below


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class WorkloadSet:
    name: str
    what: str
    workloads: tuple[Workload, ...]
    smoke_workloads: tuple[Workload, ...]  # `--smoke`: the tiny CPU model's shapes
    sampling: Sampling | None  # None: settings' (the default set's)
    arms: tuple[str, ...] | None  # None: make_arms' default
    online: bool  # whether the servers run after the offline engines
    est_offline_s: float  # rough cost of one arm's offline engine, for the budget


@dataclass(frozen=True)
class RunShape:
    workload_set: str
    workloads: tuple[Workload, ...]
    sampling: Sampling
    max_model_len: int
    prompt_id_range: tuple[int, int]
    lone_prefill_lens: tuple[int, ...]
    correctness_lengths: tuple[int, ...]
    kv_cache_dtype: str
    adjustments: tuple[str, ...]  # what was changed to fit the model, said in the plan


def workload_set(name: str, long_decode_requests: int = LONG_DECODE_REQUESTS[0]) -> WorkloadSet:
    """The set `name`; the default set's workloads are settings' at call time (`--smoke`)."""
    if name == "default":
        return WorkloadSet(
            "default",
            "the three offline workloads and the servers",
            tuple(settings.WORKLOADS),
            tuple(settings.WORKLOADS),
            None,
            None,
            online=True,
            est_offline_s=110.0,
        )
    if name == "sampling":
        return WorkloadSet(
            "sampling",
            "sampling-bound: 512 short prompts, long outputs, penalties on",
            (Workload("512x128-512", 512, 128, 512, seed=4),),
            (Workload("4x16-8", 4, 16, 8, seed=4),),
            Sampling(0.8, 50, 0.95, repetition_penalty=1.1),
            ("FLASH_ATTN_v1", "fuselane_all_v1"),
            online=False,
            est_offline_s=120.0,
        )
    if name == "long-prompts":
        return WorkloadSet(
            "long-prompts",
            "prefill-bound: 16,384-token prompts",
            (Workload("8x16384-128", 8, 16384, 128, seed=5),),
            (Workload("2x128-4", 2, 128, 4, seed=5),),
            None,
            None,
            online=False,
            est_offline_s=110.0,
        )
    if name == "long-decode":
        n = long_decode_requests
        return WorkloadSet(
            "long-decode",
            "decode over 32,768-token contexts",
            (Workload(f"{n}x32768-1024", n, 32768, 1024, seed=6),),
            (Workload("2x128-16", 2, 128, 16, seed=6),),
            None,
            None,
            online=False,
            est_offline_s=150.0,
        )
    raise ValueError(f"unknown workload set {name!r}; known: {', '.join(SET_NAMES)}")


def long_decode_requests(gpu_memory_mib: float | None, tensor_parallel: int = 1) -> int:
    """16 requests where the engine's GPUs hold >= LONG_DECODE_BIG_GPU_GIB, else 8; 16 where the
    memory is unknown (a dry run off the GPU)."""
    if gpu_memory_mib is None:
        return LONG_DECODE_REQUESTS[0]
    big = gpu_memory_mib * tensor_parallel / 1024 >= LONG_DECODE_BIG_GPU_GIB
    return LONG_DECODE_REQUESTS[0] if big else LONG_DECODE_REQUESTS[1]


def gpu_memory_mib(device: dict[str, Any]) -> float | None:
    """The memory of report.device_info()'s GPU ("81559 MiB"), None when unknown."""
    text = str(device.get("memory") or "").split()
    try:
        return float(text[0]) if text and text[-1] == "MiB" else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Model folders
# ---------------------------------------------------------------------------------------------


def model_names() -> list[str]:
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json"))


def resolve_model(value: str) -> Path:
    """`--model`: a folder holding a config.json, or the name of one under models/."""
    path = Path(value)
    if (path / "config.json").is_file():
        return path
    named = MODELS_DIR / value
    if "/" not in value and (named / "config.json").is_file():
        return named
    raise ValueError(
        f"--model {value!r}: neither a folder with a config.json nor one of {model_names()}"
    )


def read_model_config(model: str | Path) -> dict[str, Any]:
    return json.loads((Path(model) / "config.json").read_text())


def kernel_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the kernels see of a model config (models/README.md), for the report's plan."""
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return {
        "architectures": cfg.get("architectures"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "head_size": head_dim,
        "vocab_size": cfg.get("vocab_size"),
        "sliding_window": window,
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


# ---------------------------------------------------------------------------------------------
# The run's shape
# ---------------------------------------------------------------------------------------------


def _name(w: Workload) -> str:
    return f"{w.num_prompts}x{w.input_len}-{w.output_len}"


def plan_shape(
    set_name: str,
    model_config: dict[str, Any],
    *,
    smoke: bool = False,
    kv_cache_dtype: str = "auto",
    long_decode_requests: int = LONG_DECODE_REQUESTS[0],
) -> RunShape:
    """The engine shape of a set on a model, from settings' current values (after `--smoke`
    and `--golden`): max_model_len, prompt ids below the vocabulary, requests that fit."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
    ws = workload_set(set_name, long_decode_requests)
    workloads = ws.smoke_workloads if smoke else ws.workloads
    sampling = ws.sampling or Sampling(settings.TEMPERATURE, settings.TOP_K, settings.TOP_P)
    correctness = tuple(settings.CORRECTNESS_LENGTHS)
    lone = tuple(settings.LONE_PREFILL_LENS)
    need = max(
        max(w.input_len + w.output_len for w in workloads),
        max(correctness) + settings.CORRECTNESS_OUTPUT,
        max(lone) + 1,  # a lone prefill generates one token
    )
    base = settings.MAX_MODEL_LEN
    max_len = base if need <= base else need + HEADROOM
    adjustments: list[str] = []
    limit = model_config.get("max_position_embeddings")
    if limit and max_len > limit:
        adjustments.append(f"max_model_len {max_len} -> {limit} (max_position_embeddings)")
        max_len = int(limit)
        fitted = []
        for w in workloads:
            if w.input_len + w.output_len > max_len:
                short = replace(w, input_len=max_len - w.output_len)
                short = replace(short, name=_name(short))
                adjustments.append(f"workload {w.name} -> {short.name}")
                w = short
            fitted.append(w)
        workloads = tuple(fitted)
        out = settings.CORRECTNESS_OUTPUT
        if any(n + out > max_len for n in correctness):
            correctness = tuple(min(n, max_len - out) for n in correctness)
            adjustments.append(f"correctness lengths -> {list(correctness)}")
        if any(n + 1 > max_len for n in lone):
            lone = tuple(dict.fromkeys(min(n, max_len - 1) for n in lone))
            adjustments.append(f"lone prefill lengths -> {list(lone)}")
    lo, hi = settings.PROMPT_ID_RANGE
    vocab = int(model_config.get("vocab_size") or hi)
    if vocab < hi:  # Mistral's 32,000: every drawn id must be a token of the model
        adjustments.append(f"prompt ids below {vocab} (vocab_size)")
        hi = vocab
    return RunShape(
        workload_set=set_name,
        workloads=tuple(workloads),
        sampling=sampling,
        max_model_len=max_len,
        prompt_id_range=(lo, hi),
        lone_prefill_lens=lone,
        correctness_lengths=correctness,
        kv_cache_dtype=kv_cache_dtype,
        adjustments=tuple(adjustments),
    )


def apply_shape(shape: RunShape) -> None:
    """Write the shape into `settings`, where the run's modules read it."""
    settings.WORKLOAD_SET = shape.workload_set
    settings.WORKLOADS = shape.workloads
    s = shape.sampling
    settings.TEMPERATURE, settings.TOP_K, settings.TOP_P = s.temperature, s.top_k, s.top_p
    settings.REPETITION_PENALTY = s.repetition_penalty
    settings.MAX_MODEL_LEN = shape.max_model_len
    settings.PROMPT_ID_RANGE = shape.prompt_id_range
    settings.LONE_PREFILL_LENS = shape.lone_prefill_lens
    settings.CORRECTNESS_LENGTHS = shape.correctness_lengths
    settings.KV_CACHE_DTYPE = shape.kv_cache_dtype
    settings.ADJUSTMENTS = shape.adjustments

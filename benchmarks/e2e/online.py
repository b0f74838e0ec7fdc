"""An arm's online run: vLLM's OpenAI server on the model with a generated tokenizer, driven by
`fuselane.serving.loadgen.run_load` at the run's request rates and summarized by
`fuselane.serving.bench_serve.summarize` (TTFT / ITL / throughput); with --telemetry, the
`fuselane_*` samples of a fuselane arm's `/metrics` afterwards.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import shutil
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import settings
from arms import Arm, server_command, server_env
from processes import free_port, owned_process, wait_server
from settings import build_prompts, online_plan

# What each request rate's summary keeps of bench_serve's.
ONLINE_SUMMARY_KEYS = (
    "duration",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "mean_itl_ms",
    "median_tpot_ms",
    "median_e2el_ms",
    "errors",
)


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
                "model_max_length": settings.MAX_MODEL_LEN,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    return dest


async def drive_online(base_url: str, plan: list[dict[str, Any]]) -> dict[str, Any]:
    """A warm-up burst, then each point of `plan` (an `online_plan`): its Poisson load, and
    bench_serve's summary of it."""
    from fuselane.serving.bench_serve import summarize
    from fuselane.serving.loadgen import Endpoint, RequestSpec, run_load

    ep = Endpoint("e2e", base_url, model="llama8b")
    extra = {"temperature": settings.TEMPERATURE, "top_k": settings.TOP_K, "top_p": settings.TOP_P}
    if settings.REPETITION_PENALTY != 1.0:  # vLLM's extra parameter; absent: off
        extra["repetition_penalty"] = settings.REPETITION_PENALTY
    input_len, output_len = settings.ONLINE_INPUT_LEN, settings.ONLINE_OUTPUT_LEN
    warm = [RequestSpec(p, 16, len(p)) for p in build_prompts(8, input_len, seed=98)]
    await run_load(ep, warm, request_rate=math.inf, extra_body=extra)
    out = {}
    for point in plan:
        prompts = build_prompts(point["num_requests"], input_len, point["seed"])
        reqs = [RequestSpec(p, output_len, len(p)) for p in prompts]
        res = await run_load(
            ep, reqs, request_rate=point["rate"], extra_body=extra, seed=point["seed"]
        )
        s = summarize(res.records, res.duration_s)
        out[f"rate_{point['rate']:g}"] = {
            "request_rate": point["rate"],
            "num_requests": point["num_requests"],
            "input_len": input_len,
            "output_len": output_len,
            **{k: s.get(k) for k in ONLINE_SUMMARY_KEYS},
        }
    return out


def scrape_fuselane_metrics(base_url: str) -> dict[str, Any]:
    """The `fuselane_*` samples of the server's `/metrics` (launch counts, fallbacks, ...)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("fuselane_")]
    launches: dict[str, float] = {}
    for ln in lines:
        if ln.startswith("fuselane_kernel_launches_total{"):
            labels, value = ln.rsplit(" ", 1)
            launches[labels.removeprefix("fuselane_kernel_launches_total")] = float(value)
    return {"samples": len(lines), "launches": launches, "lines": lines[:200]}


def run_online(
    arm: Arm, model_dir: Path, log_path: Path, quick: bool, start_timeout: float
) -> dict[str, Any]:
    """The arm's server, up to `start_timeout` s to answer, then the load; the server is
    stopped when this returns, whatever happened."""
    import_httpx()
    port = free_port()
    cmd = server_command(arm, model_dir, port)
    base_url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"command": " ".join(cmd)}
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        with owned_process(cmd, server_env(arm), log) as proc:
            try:
                wait_server(proc, base_url, start_timeout)
                result["engine_start_s"] = time.perf_counter() - t0
                result["rates"] = asyncio.run(drive_online(base_url, online_plan(quick)))
                if settings.TELEMETRY and arm.needs_fuselane:
                    time.sleep(3.0)  # the engine processes publish their counts every second
                    result["metrics"] = scrape_fuselane_metrics(base_url)
                result["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded
                result["status"] = "failed"
                result["error"] = f"{type(e).__name__}: {e}"
    return result

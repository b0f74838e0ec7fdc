"""Offline Hugging Face configs for the models vLLM's attention-backend tests name.

The tests build a `ModelConfig` from a hub name (`meta-llama/Meta-Llama-3-8B`,
`microsoft/Phi-tiny-MoE-instruct`, `google/embeddinggemma-300m`) and read only its attention
geometry: query and KV heads, head size, sliding window and dtype. The GPU machine has no
network and two of the repositories are gated, so the runner writes a `config.json` for each
into a private hub cache (`HF_HOME`, `HF_HUB_OFFLINE=1`) laid out as `huggingface_hub` keeps
one; the test ids and the names vLLM resolves stay the real ones. A model the cache already
holds (a real `HF_HOME` passed with `--hf-home`) is used as it is.

Each entry is the published config's attention-relevant fields plus what transformers needs to
parse it; `verified` says whether those fields were checked against the published file when
this table was written (the JSON results repeat it, so a stock backend's result on a model
whose geometry was not verified is read as such).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Any 40-hex name works as the snapshot revision; `refs/main` points at it.
REVISION = "0" * 40


@dataclass(frozen=True)
class ModelStandIn:
    name: str
    config: dict[str, Any]
    verified: bool
    note: str

    def geometry(self) -> dict[str, Any]:
        """The fields the tests read, for the results file."""
        c = self.config
        heads = c["num_attention_heads"]
        return {
            "num_attention_heads": heads,
            "num_key_value_heads": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim", c["hidden_size"] // heads),
            "sliding_window": c.get("sliding_window"),
            "torch_dtype": c.get("torch_dtype"),
            "verified": self.verified,
        }


MODELS: dict[str, ModelStandIn] = {
    m.name: m
    for m in (
        ModelStandIn(
            "meta-llama/Meta-Llama-3-8B",
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-05,
                "rope_theta": 500000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "bos_token_id": 128000,
                "eos_token_id": 128001,
            },
            verified=True,
            note="the published config (32 query heads, 8 KV heads, head size 128, bf16)",
        ),
        ModelStandIn(
            "microsoft/Phi-tiny-MoE-instruct",
            {
                # The published config names remote code (auto_map); the tests build it with
                # trust_remote_code=False, so transformers' own PhiMoE config parses it.
                "architectures": ["PhiMoEForCausalLM"],
                "model_type": "phimoe",
                "hidden_size": 4096,
                "intermediate_size": 448,
                "num_hidden_layers": 32,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_local_experts": 16,
                "num_experts_per_tok": 2,
                "vocab_size": 32064,
                "max_position_embeddings": 4096,
                "sliding_window": 2047,
                "rope_theta": 10000.0,
                "rms_norm_eps": 1e-05,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": 32000,
            },
            verified=False,
            note="SlimMoE's Phi-tiny-MoE geometry as recalled (16 query heads, 4 KV heads, head "
            "size 128, window 2047, bf16); the published file could not be read from here",
        ),
        ModelStandIn(
            "google/embeddinggemma-300m",
            {
                "architectures": ["Gemma3TextModel"],
                "model_type": "gemma3_text",
                "hidden_size": 768,
                "intermediate_size": 1152,
                "num_hidden_layers": 24,
                "num_attention_heads": 3,
                "num_key_value_heads": 1,
                "head_dim": 256,
                "query_pre_attn_scalar": 256,
                "sliding_window": 512,
                "max_position_embeddings": 2048,
                "use_bidirectional_attention": True,
                "vocab_size": 262144,
                "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "rms_norm_eps": 1e-06,
                "hidden_activation": "gelu_pytorch_tanh",
                "torch_dtype": "float32",
            },
            verified=False,
            note="EmbeddingGemma's Gemma-3 text geometry as recalled (3 query heads, 1 KV head, "
            "head size 256, window 512); encoder-only, which fuselane refuses",
        ),
    )
}


def cached_config(hf_home: Path, name: str) -> Path | None:
    """The `config.json` the hub cache under `hf_home` holds for `name` at `main`, or None."""
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    config = repo / "snapshots" / ref.read_text().strip() / "config.json"
    return config if config.is_file() else None


def write_hub_cache(
    hf_home: Path, names: list[str], real_home: Path | None = None
) -> dict[str, dict[str, Any]]:
    """Give every model in `names` a `config.json` in the private hub cache under `hf_home`:
    the one a real cache (`real_home`) holds, else the table's stand-in. The real cache is only
    read.

    Returns, per model, where its config came from and the geometry the tests read.
    Raises KeyError for a model neither the real cache nor the table has.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        existing = cached_config(real_home, name) if real_home is not None else None
        if existing is not None:
            config = json.loads(existing.read_text())
            model = ModelStandIn(name, config, True, f"from {existing}")
        elif name in MODELS:
            model = MODELS[name]
        else:
            raise KeyError(
                f"vLLM's test names the model {name!r}: no config for it in the hub cache "
                "and none in benchmarks/vllm_backend_tests/models.py; add one there or pass "
                "--hf-home with a cache that holds it"
            )
        repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        out[name] = {"source": model.note, **model.geometry()}
    return out

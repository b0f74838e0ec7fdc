"""The tiny model builder (`fuselane tiny-model DIR`): deterministic, loadable by transformers
and vLLM, and both compute the same greedy tokens from it."""

from __future__ import annotations

import json

import pytest
import torch

from fuselane.serving.tiny_model import (
    BOS,
    EOS,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    VOCAB_SIZE,
    build_tiny_model,
)
from tests.plugin.engine_runner import PROMPTS
from tests.plugin.engines import run_engine

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_build_is_deterministic(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in FILES:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_config_fits_vllm_cpu_and_fuselane(model_dir):
    from fuselane.kernels import attention

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == HEAD_DIM >= 32  # vLLM's CPU attention takes head sizes >= 32
    assert HEAD_DIM in attention.SUPPORTED_HEAD_SIZES
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (
        NUM_LAYERS,
        NUM_KV_HEADS,
    )


def test_tokenizer_and_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) <= VOCAB_SIZE
    text = "The kernel writes the keys, 12345 times!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(BOS)
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Count to five."}], tokenize=False, add_generation_prompt=True
    )
    assert chat == f"{BOS}<|user|>\nCount to five.{EOS}\n<|assistant|>\n"


def test_transformers_and_vllm_agree(model_dir, tmp_path):
    """Greedy fp32 tokens of transformers' Llama equal vLLM's (stock kernels) on the same files."""
    from transformers import AutoModelForCausalLM

    vllm_result, _ = run_engine(
        model_dir, tmp_path, "stock32", None, "--tokens", "8", dtype="float32"
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for i in (0, 2):  # a short prompt and a long one
        ids = torch.tensor([vllm_result["prompt_ids"][i]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out[0, ids.shape[1] :].tolist() == vllm_result["greedy"][i], PROMPTS[i]

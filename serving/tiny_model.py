"""A tiny Llama-architecture model, built offline: the default model of `fuselane tiny-model DIR`.

It exists so that the whole serving stack (vLLM engine, the plugin's kernels, the OpenAI server,
the canary) runs on a laptop or a CI runner with no network and no downloads:

- config: `LlamaForCausalLM`, 2 layers, hidden 128, 4 query heads over 2 KV heads (GQA), head
  size 64 (vLLM's CPU attention takes 32, 64, 80, ...; fuselane's kernels 64, 80, 96, 128,
  256: 64 is the smallest both run), vocab 512, float32;
- weights: drawn from a fixed seed with `torch.Generator`, written as safetensors. They are
  random, so the text is gibberish; their scale (std 0.1 in the body instead of the usual
  0.02, 0.45 in the output projection) gives non-trivial attention patterns and a peaked
  next-token distribution, so greedy decoding has clear winners and greedy comparisons between
  two attention implementations are meaningful;
- tokenizer: byte-level BPE trained with `tokenizers` on a corpus generated here from word
  lists with a fixed seed, with a chat template, so the chat endpoint works.

The same seed gives the same files on every machine and with every transformers version (the
weights are drawn here, not by a library's initializer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SEED = 20250601
NUM_LAYERS = 2
HIDDEN_SIZE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2
# Independent of hidden_size (Llama's config allows it): the smallest head size that vLLM's CPU
# attention and fuselane's kernels both support.
HEAD_DIM = 64
INTERMEDIATE_SIZE = 256
VOCAB_SIZE = 512
MAX_POSITIONS = 2048
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
# Weight std of the body: attention scores with a spread of ~1.3 (neither uniform nor one-hot).
WEIGHT_STD = 0.1
# The output projection is wider so the logits spread by ~5: greedy picks have clear margins.
LM_HEAD_STD = 0.45
CORPUS_LINES = 4000

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, *ROLE_TOKENS)

# Role marker, newline, content, EOS: the format the BPE corpus below also contains.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

# Word lists for the corpus, "|"-separated.
_SUBJECTS = (
    "the kernel|a token|the cache|every request|the scheduler|a small model|the engine|"
    "the server|our canary|each layer|the sampler|a block|the queue|one worker|the batch|"
    "a prompt|the graph|this page"
).split("|")
_VERBS = (
    "writes|reads|moves|serves|checks|skips|fuses|samples|measures|waits for|returns|updates|"
    "streams|computes|stores|drops"
).split("|")
_OBJECTS = (
    "the keys|the values|a new page|ten tokens|the logits|every head|the output|a long context|"
    "the first chunk|its metrics|the answer|a short reply|the next word|two blocks|the prefix|"
    "all the rows"
).split("|")
_TAILS = (
    "| quickly| again| in order| on time| without a copy| for the user| before the step|"
    " after the prefill| in one launch"
).split("|")
_QUESTIONS = (
    "What is a paged cache?|How fast is the server?|Tell me a story.|Which kernel runs first?|"
    "Why does the batch grow?|Hello, who are you?|Write a short poem.|Count to five.|"
    "What does the sampler do?"
).split("|")


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
    return s[0].upper() + s[1:]


def build_corpus(num_lines: int = CORPUS_LINES, seed: int = SEED) -> list[str]:
    """Lines of English-like text and chat transcripts, the same for a given seed."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        if i % 5 == 4:
            question = rng.choice(_QUESTIONS)
            answer = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
            lines.append(f"<|user|>\n{question}{EOS}\n<|assistant|>\n{answer}{EOS}")
        else:
            text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
            if i % 7 == 0:
                text += f" {rng.randint(0, 99999)} {rng.random():.3f}"
            lines.append(text)
    return lines


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) that adds BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, model vocab {vocab_size}")
    return tok


def hf_config(bos_id: int, eos_id: int) -> dict:
    """The HF `config.json` of the tiny model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "initializer_range": WEIGHT_STD,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def random_weights(seed: int = SEED) -> dict[str, torch.Tensor]:
    """Llama state dict (HF names) drawn from `seed`: norms are ones, the rest N(0, std)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = WEIGHT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_size, HIDDEN_SIZE)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, q_size)
        weights[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
    weights["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE, std=LM_HEAD_STD)
    return weights


def build_tiny_model(path: str | Path, seed: int = SEED) -> Path:
    """Write the tiny model (config, safetensors weights, tokenizer, chat template) to `path`.

    Returns the directory, which `vllm` (`LLM(model=...)`, the OpenAI server's `--model`) and
    `transformers.AutoModelForCausalLM.from_pretrained` both load. Existing files are replaced.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(build_corpus(seed=seed))
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)

    (out / "config.json").write_text(json.dumps(hf_config(bos_id, eos_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2) + "\n"
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_tokens_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")

    save_file(random_weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Run a real vLLM engine (in this process) on a fixed workload and write what it did as JSON.

The plugin tests start this script in a fresh process per engine, so every engine sees its
own FUSELANE_KERNELS, gets the plugin through the installed entry point and leaves nothing
behind in the test process. It runs vLLM's in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the counters below see every call the engine makes:
before the engine starts, the kernel entry points the plugin calls
(`fuselane.kernels.attention.attention`, `fuselane.kernels.kv_cache.kv_write`, ...: the
checked entry points, which a layer's first call takes) are wrapped with call counters.

    python tests/plugin/engine_runner.py MODEL_DIR OUT.json [--dtype float32] [--tokens 12]
        [--golden]

`--golden` makes the greedy pass the golden one (tests/golden compares it with its committed
file): PROMPTS and GOLDEN_EXTRA (GOLDEN_PROMPTS), GOLDEN_TOKENS tokens each with the top
GOLDEN_TOP_LOGPROBS logprobs of every step, in one batch; the greedy results of PROMPTS are its
first `--tokens` steps, as without it. The golden check costs no engine start and no pass of its
own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

# A fixed prompt set: short and long prompts (the long ones cross kernel-block boundaries and,
# with the small token budget below, are prefilled in chunks alongside other requests'
# decodes), and two that share a long prefix (prefix caching hands the second one cached
# blocks).
_SHARED = (
    "The scheduler moves every request into the batch before the step, and the kernel writes "
    "the keys and the values into a new page of the cache without a copy. "
) * 3
PROMPTS = [
    "Hello, the kernel writes",
    "What is a paged cache?",
    _SHARED + "Then the sampler",
    _SHARED + "Which kernel runs first?",
    "Count to five. " * 20,
    "A",
]
# vLLM schedules at most this many tokens per step: long prompts are chunked and mixed with
# decodes (the mixed decode + prefill path of the attention kernels).
MAX_NUM_BATCHED_TOKENS = 64
TOP_LOGPROBS = 2

# The golden prompts (tests/golden): PROMPTS and two more, so that they span 1 to ~400 tokens
# with the tiny model's tokenizer (BOS included): 8 prompts, one batch of max_num_seqs. Under
# Triton's interpreter fuselane's engine pays ~0.4 s of CPU per sequence and decode step (a
# ~400-token prompt about twice a short one's total), so the golden pass replaces the greedy
# pass instead of following it: 8 x 32 sequence-steps in place of 6 x 12. Every greedy step of
# these prompts has a clear winner (tests/golden/golden.py NEAR_TIE).
_SENTENCES = (
    "The scheduler moves every request into the batch before the step.",
    "Each layer reads the keys and the values of the prefix from the paged cache.",
    "The sampler checks the logits of the batch before it picks the next word.",
    "A block of 16 tokens holds 4096 values at 0.25 ms a step.",
    "Our canary serves one worker quickly, then streams the answer to the user.",
    "Why does the batch grow? Because the queue returns two blocks on time.",
    "The engine computes the first chunk in one launch and stores its metrics.",
)
# 405 tokens: 16 sentences in turn, the repeats numbered so that no two are equal.
_LONG = " ".join(
    _SENTENCES[i % len(_SENTENCES)] + (f" ({i})" if i >= len(_SENTENCES) else "") for i in range(16)
)
GOLDEN_EXTRA = [
    "",  # BOS alone: a one-token prompt
    _LONG,
]
GOLDEN_PROMPTS = PROMPTS + GOLDEN_EXTRA
GOLDEN_TOKENS = 32
GOLDEN_TOP_LOGPROBS = 5
MAX_NUM_SEQS = 8

# (module, function) entry points the plugin calls: counted in this process.
COUNTED = (
    ("fuselane.kernels.attention", "attention"),
    ("fuselane.kernels.kv_cache", "kv_write"),
    ("fuselane.kernels.kv_cache", "rope_kv_write"),
    ("fuselane.kernels.sampling", "fused_sample"),
)


def install_counters(counts: Counter) -> None:
    import importlib

    for module_name, name in COUNTED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, name, None)
        if fn is None:
            continue

        def counted(*args, __fn=fn, __key=f"{module_name}.{name}", **kwargs):
            counts[__key] += 1
            return __fn(*args, **kwargs)

        setattr(module, name, counted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--golden", action="store_true", help="the greedy pass is the golden one")
    args = parser.parse_args(argv)
    if args.golden and args.tokens > GOLDEN_TOKENS:
        parser.error(f"--golden generates {GOLDEN_TOKENS} tokens: --tokens at most that")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    counts: Counter = Counter()
    install_counters(counts)

    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=512,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    prompts, tokens, top = PROMPTS, args.tokens, TOP_LOGPROBS
    if args.golden:
        prompts, tokens, top = GOLDEN_PROMPTS, GOLDEN_TOKENS, GOLDEN_TOP_LOGPROBS
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=top)
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    # What the greedy pass costs (CPU time: about the same on a busy machine): with and without
    # --golden, the golden prompts' cost in the tests.
    result: dict = {
        "greedy_s": time.perf_counter() - t0,
        "greedy_cpu_s": time.process_time() - cpu0,
    }
    result.update(greedy=[], logprobs=[], top2=[], prompt_ids=[])
    for o in outs[: len(PROMPTS)]:
        c = o.outputs[0]
        ids, steps = list(c.token_ids)[: args.tokens], c.logprobs[: args.tokens]
        result["prompt_ids"].append(list(o.prompt_token_ids))
        result["greedy"].append(ids)
        result["logprobs"].append([step[t].logprob for t, step in zip(ids, steps, strict=True)])
        # Margin between the two best tokens at each step: how firm each greedy pick was.
        result["top2"].append(
            [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in steps]
        )
    if args.golden:
        result["golden"] = [golden_record(o) for o in outs]
    seeded = SamplingParams(
        max_tokens=args.tokens, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    result["sampled"] = [
        [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], seeded, use_tqdm=False)]
        for _ in range(2)
    ]
    result["counts"] = dict(counts)
    # Layers after a step's first replay its recorded launches (kernels/_launch.LaunchCache).
    from fuselane.kernels import attention, kv_cache

    result["launch_replays"] = {
        "attention": attention.LAUNCHES.hits,
        "kv_cache": kv_cache.WRITE_LAUNCHES.hits,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def golden_record(output) -> dict:
    """One prompt of the golden pass: its ids, the generated ids and, per step, the top
    GOLDEN_TOP_LOGPROBS `[token id, logprob]` pairs, best first."""
    c = output.outputs[0]
    return {
        "prompt_ids": list(output.prompt_token_ids),
        "token_ids": list(c.token_ids),
        "top_logprobs": [
            sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda p: -p[1])[
                :GOLDEN_TOP_LOGPROBS
            ]
            for step in c.logprobs
        ],
    }


if __name__ == "__main__":
    sys.exit(main())

"""Run a real vLLM engine (in this process) on a fixed workload and write what it did as JSON.

The plugin tests start this script in a fresh process per engine, so every engine sees its
own FUSELANE_KERNELS, gets the plugin through the installed entry point and leaves nothing
behind in the test process. It runs vLLM's in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the counters below see every call the engine makes:
before the engine starts, the kernel entry points the plugin calls
(`fuselane.kernels.attention.attention`, `fuselane.kernels.kv_cache.kv_write`, ...: the
checked entry points, which a layer's first call takes) are wrapped with call counters.

    python tests/plugin/engine_runner.py MODEL_DIR OUT.json [--dtype float32] [--tokens 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    args = parser.parse_args(argv)

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
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    greedy = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    result = {"greedy": [], "logprobs": [], "top2": [], "prompt_ids": []}
    for o in outs:
        c = o.outputs[0]
        result["prompt_ids"].append(list(o.prompt_token_ids))
        result["greedy"].append(list(c.token_ids))
        result["logprobs"].append(
            [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
        )
        # Margin between the two best tokens at each step: how firm each greedy pick was.
        result["top2"].append(
            [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in c.logprobs]
        )
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


if __name__ == "__main__":
    sys.exit(main())

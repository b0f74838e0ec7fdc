"""Run a real vLLM engine (in this process) through sampling workloads; write what it did as JSON.

Used by test_sampler_hook.py, one fresh process per engine (its own FUSELANE_KERNELS, the plugin
through the installed entry point). In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
`fuselane.plugin.sampler_hook.counters()` read here are the engine's own. After each workload
the counters are snapshotted, so the tests see which path each workload's batches took.

    python tests/plugin/sampler_runner.py MODEL_DIR OUT.json [--dtype float32] [--tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_runner import PROMPTS

TOP_LOGPROBS = 3


def _counters() -> dict:
    try:
        from fuselane.plugin import sampler_hook
    except ImportError:
        return {}
    return sampler_hook.counters()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=512,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
    )
    result: dict = {"phases": {}}
    before = _counters()

    def phase(name: str) -> None:
        nonlocal before
        now = _counters()
        result["phases"][name] = {k: v - before.get(k, 0) for k, v in now.items()}
        before = now

    n = args.tokens
    sampler_cls = None
    try:
        from vllm.v1.worker import gpu_model_runner

        sampler_cls = gpu_model_runner.Sampler.__name__
    except ImportError:
        pass
    result["runner_sampler"] = sampler_cls
    phase("startup")

    # Greedy with top-n logprobs.
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    result["logprobs"] = [
        [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
        for o in outs
    ]
    phase("greedy")

    # Seeded random sampling with temperature / top-k / top-p (twice: reproducible).
    seeded = [
        SamplingParams(
            max_tokens=n, temperature=0.9, top_p=0.9, top_k=50, seed=1234 + i, ignore_eos=True
        )
        for i in range(3)
    ]
    result["sampled"] = [
        [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], seeded, use_tqdm=False)]
        for _ in range(2)
    ]
    phase("seeded")

    # Penalties, min-p and logit bias (all fused), mixed with a greedy row.
    bias_token = result["greedy"][1][0]  # the greedy row below must avoid it
    mixed = [
        SamplingParams(
            max_tokens=n,
            temperature=0.8,
            min_p=0.05,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            seed=7,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=n,
            temperature=0.0,
            logit_bias={bias_token: -100.0},
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=n,
            temperature=0.0,
            repetition_penalty=1.5,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            ignore_eos=True,
        ),
    ]
    outs = llm.generate(PROMPTS[:3], mixed, use_tqdm=False)
    result["mixed"] = [list(o.outputs[0].token_ids) for o in outs]
    result["bias_token"] = bias_token
    phase("mixed")

    # Features the kernel does not cover: vLLM's own sampler takes those batches.
    allowed = sorted(set(result["greedy"][1][:3]))
    outs = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(
                max_tokens=n, temperature=0.0, allowed_token_ids=allowed, ignore_eos=True
            ),
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    result["allowed_ids"] = allowed
    result["allowed"] = [list(o.outputs[0].token_ids) for o in outs]
    phase("allowed_token_ids")

    # The hook in this (engine) process: installed once, undone by unregister(), re-installable.
    try:
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker import gpu_model_runner as m

        import fuselane.plugin as plugin

        ours = m.Sampler
        plugin.register()
        again = m.Sampler is ours
        plugin.unregister()
        restored = m.Sampler is Sampler
        plugin.register()
        result["hook"] = {
            "again": again,
            "restored": restored,
            "reinstalled": m.Sampler is not Sampler and issubclass(m.Sampler, Sampler),
        }
    except ImportError as e:
        result["hook"] = {"error": str(e)}

    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

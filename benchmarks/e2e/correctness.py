"""Correctness of the end-to-end run: the greedy pass each offline engine runs (on re-initialized
weights), the comparison of an arm's pass with its reference's (token agreement, logprob
deviations, where and how close the first divergence is), and the verdict rule.

The pass and the re-init run inside the arm's engine process; the comparison and the verdict in
the parent, on the passes' JSON.
"""

from __future__ import annotations

from typing import Any

import settings

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


# ---------------------------------------------------------------------------------------------
# The pass (runs in the arm's engine process)
# ---------------------------------------------------------------------------------------------


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


def _logprob_value(x: Any) -> float:
    return float(getattr(x, "logprob", x))


def run_correctness(llm: Any) -> dict[str, Any]:
    """Greedy outputs of the correctness prompts: token ids, top logprobs of every generated
    token, and the prompt logprobs of the short prompts."""
    from vllm import SamplingParams

    prompts = settings.correctness_prompts()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=settings.CORRECTNESS_OUTPUT,
            ignore_eos=True,
            logprobs=settings.CORRECTNESS_TOP_LOGPROBS,
            prompt_logprobs=0 if len(p) <= settings.CORRECTNESS_PROMPT_LOGPROBS_MAX_LEN else None,
            detokenize=False,
        )
        for p in prompts
    ]
    outs = llm.generate(settings.tokens_prompts(prompts), params, use_tqdm=False)
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


# ---------------------------------------------------------------------------------------------
# The comparison and the verdict (the parent, on the passes' JSON)
# ---------------------------------------------------------------------------------------------


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


def largest_gap(c: dict[str, Any]) -> float | None:
    """The largest reference gap at a first divergence of a comparison (inf: the other's token
    was not in the reference's top list); None where no prompt diverged."""
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

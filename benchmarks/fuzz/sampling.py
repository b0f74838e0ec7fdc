"""The sampling family: `fused_sample` against `sample_reference` on random batches.

A profile fixes what the kernels compile for: the vocabulary (it sets the chunking), logits
dtype, the rounding (`arith`), which parameters the batch carries (temperature, top-k in either
index dtype, top-p, min-p, penalties with or without the output mask, state slots, logit bias),
the seed mode (every row seeded, some, none), seed offsets, the log-probabilities asked for
(None, 0, n in each top-n width) and their mode, writable logits, and rarely a small
chunk / candidate cap that forces the exact fallback. A case draws the batch (1-256 rows) and
every row's values: greedy rows, tiny and large temperatures, top-k off / 1 / V / above V,
top-p and min-p at their ends, penalties, padded bias lists with duplicates and -inf, seeds,
and logits with NaN, -inf bands, single finite values, equal values and ties.

Seeded and greedy rows must draw the reference's token; unseeded rows draw from torch's
generator, so they are checked against the reference's kept set and, over the whole run, for
their distribution (`sampling_checks.py`). Outputs are poisoned in the workspace before every call.
"""

from __future__ import annotations

import random

import torch

from fuselane.benchmarks.fuzz.core import (
    INVALID_RATE,
    Family,
    call_kernel,
    covering,
    generator,
    log_uniform,
)
from fuselane.benchmarks.fuzz.sampling_checks import check_case, distribution_check
from fuselane.kernels import sampling as smp
from fuselane.plugin import sampling_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Llama-3's first (the first profile's), then Qwen2's, Llama-2's, Gemma's, small and odd ones.
VOCABS = {
    "full": [128256, 151936, 32000, 262144, 4231, 1000, 131, 1],
    "small": [1000, 131, 2111, 37, 1],
    "sanitizer": [128256, 32000, 4231, 131],
}
BATCH = {"full": 256, "small": 3, "sanitizer": 16}
# Chunk / candidate-cap overrides (compile-time constants): None = the launch rule's.
CHUNKS = {"full": [None, None, None, [512, 16], [128, 8]], "small": [None, None, [128, 8]],
          "sanitizer": [None, None, [128, 8]]}  # fmt: skip
LOGPROB_CLASSES = {None: None, "0": (0, 0), "1-8": (1, 8), "9-32": (9, 32), "33-128": (33, 128)}
ROW_KINDS = ("plain",) * 8 + ("nan_some", "nan_all", "inf_band", "one_finite", "all_equal",
                               "ties", "huge")  # fmt: skip
VIOLATIONS = {
    "num_logprobs": "num_logprobs",
    "logits_dtype": "logits",
    "logprobs_mode": "logprobs_mode",
    "temperature_shape": "temperature",
    "top_k_dtype": "top_k",
    "has_seed_without_seeds": "has_seed",
    "penalty_without_masks": "prompt_bin_mask",
    "bias_without_counts": "logit_bias_counts",
    "workspace_small": "workspace",
}


def profiles(rng: random.Random, count: int, scale: str) -> list[dict]:
    """vLLM V2's common batch first (T / top-k / top-p, every row seeded), then `count - 1`
    profiles covering the choices. The workspace is a profile's (vLLM sizes it once per
    engine): its sizes are kernel arguments Triton specializes on."""
    first = dict(vocab=VOCABS[scale][0], dtype="float32", arith="triton", temperature=True,
                 top_k="int32", top_p=True, min_p=False, penalties=None, out_mask=False,
                 slots=None, bias=False, seed_mode="all", offsets=True, logprobs=None,
                 mode="raw_logprobs", writable=False, chunk=None)  # fmt: skip
    rest = covering(
        rng,
        count - 1,
        dict(
            vocab=VOCABS[scale][1:],
            dtype=["float32", "float32", "bfloat16", "float16"],
            arith=["triton", "torch"],
            temperature=[True, True, True, False],
            top_k=[None, "int32", "int64"],
            top_p=[False, True],
            min_p=[False, False, True],
            penalties=[None, None, "rep", "freq+pres", "all"],
            out_mask=[False, True],
            slots=[None, "int32", "int64"],
            bias=[False, False, True],
            seed_mode=["all", "all", "mixed", "none"],
            offsets=[True, False],
            logprobs=list(LOGPROB_CLASSES),
            mode=list(smp.LOGPROBS_MODES),
            writable=[False, True],
            chunk=CHUNKS[scale],
        ),
    )
    pool = [first, *rest]
    for p in pool:
        span = LOGPROB_CLASSES[p["logprobs"]]
        p.update(
            ws_batch=BATCH[scale] + rng.choice((0, 0, 7)),
            ws_vocab=p["vocab"] + rng.choice((0, 0, 0, 61)),
            ws_logprobs=0 if span is None else span[1],
            bias_width=rng.randint(1, 32),
        )
    return pool


def draw(rng: random.Random, pool: list[dict], scale: str) -> dict:
    index = rng.randrange(len(pool))
    cfg = {"profile": index, **pool[index]}
    v = cfg["vocab"]
    # the reference's cost grows with B x V: the largest vocabularies take up to 2^25 logits
    batch = min(log_uniform(rng, 1, BATCH[scale]), max(1, 2**25 // v))
    span = LOGPROB_CLASSES[cfg["logprobs"]]
    n = None if span is None else rng.randint(*span)
    if n is not None and n > v and rng.random() < 0.8:  # mostly within the vocabulary
        n = rng.randint(min(span[0], v), v)
    cfg.update(
        batch=batch,
        num_slots=batch + (rng.randint(0, 8) if cfg["slots"] else 0),
        num_logprobs=n,
        greedy_fraction=rng.choice((0.0, 0.0, 0.25, 0.5, 1.0)),
        logit_scale=rng.choice((0.3, 1.0, 3.0, 10.0)),
        special_rows=rng.choice((0.0, 0.0, 0.15, 0.5)),
        workspace=None
        if rng.random() < 0.05
        else {
            "max_batch": cfg["ws_batch"],
            "vocab": cfg["ws_vocab"],
            "max_logprobs": max(cfg["ws_logprobs"], n or 0),
        },
        tensor_seed=rng.getrandbits(62),
    )
    if cfg["workspace"] is None:
        cfg["arith"] = "triton"  # fused_sample's own workspace rounds the default way
        cfg["chunk"] = None
    if rng.random() < INVALID_RATE:
        # a small batch that only this violation puts out of contract
        cfg.update(violation=rng.choice(sorted(VIOLATIONS)), batch=2, num_slots=2,
                   num_logprobs=None, top_k=cfg["top_k"] or "int32",
                   workspace={"max_batch": 2, "vocab": v, "max_logprobs": 8})  # fmt: skip
    return cfg


def expected_refusal(cfg: dict) -> str | None:
    violation = cfg.get("violation")
    if violation is not None:
        return VIOLATIONS[violation]
    n = cfg["num_logprobs"]
    if n is not None and n > cfg["vocab"]:  # the contract: at most V log-probabilities
        return "num_logprobs"
    return None


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _logits(cfg: dict, gen: torch.Generator, hrng: random.Random, device) -> tuple:
    """(logits [B, V] in the profile's dtype, hot token ids per row): randn * scale plus three
    strong tokens per row, and special rows."""
    b, v, s = cfg["batch"], cfg["vocab"], cfg["logit_scale"]
    x = torch.randn(b, v, generator=gen, device=device) * s
    hot = [[hrng.randrange(v) for _ in range(3)] for _ in range(b)]
    x.scatter_add_(1, torch.tensor(hot, device=device), torch.full((b, 3), 2.0 * s, device=device))
    for r in range(b):
        kind = hrng.choice(ROW_KINDS) if hrng.random() < cfg["special_rows"] else "plain"
        lo = hrng.randrange(v)
        hi = hrng.randint(lo + 1, v)
        if kind == "nan_some":
            x[r, torch.randint(0, v, (hrng.randint(1, 5),), generator=gen, device=device)] = float(
                "nan"
            )
        elif kind == "nan_all":
            x[r] = float("nan")
        elif kind == "inf_band":
            x[r, lo:hi] = float("-inf")
        elif kind == "one_finite":
            keep = x[r, lo].clone()
            x[r] = float("-inf")
            x[r, lo] = keep
        elif kind == "all_equal":
            x[r] = hrng.uniform(-3, 3)
        elif kind == "ties":
            x[r] = (x[r] * 2).round() / 2
        elif kind == "huge":
            x[r] *= 1000.0
    return x.to(DTYPES[cfg["dtype"]]), hot


def _rows(cfg: dict, hrng: random.Random, device) -> dict:
    """Per-row parameter tensors of the profile's fields."""
    b, v = cfg["batch"], cfg["vocab"]
    f32 = dict(dtype=torch.float32, device=device)
    out = {}
    if cfg["temperature"]:
        temps = [
            hrng.choice((0.0, 1e-6))
            if hrng.random() < cfg["greedy_fraction"]
            else hrng.choice((hrng.uniform(0.1, 2.0), 1.0, 1e-4))
            for _ in range(b)
        ]
        out["temperature"] = torch.tensor(temps, **f32)
    if cfg["top_k"]:
        ks = [hrng.choice((0, hrng.randint(1, min(v, 100)), hrng.randint(1, v), v, v + 5, -1))
              for _ in range(b)]  # fmt: skip
        dtype = torch.int32 if cfg["top_k"] == "int32" else torch.int64
        if cfg.get("violation") == "top_k_dtype":
            dtype = torch.float32
        out["top_k"] = torch.tensor(ks, dtype=dtype, device=device)
    if cfg["top_p"]:
        ps = [hrng.choice((1.0, hrng.uniform(0.05, 0.999), 1e-6)) for _ in range(b)]
        out["top_p"] = torch.tensor(ps, **f32)
    if cfg["min_p"]:
        mps = [hrng.choice((0.0, hrng.uniform(0.001, 0.3), 1.0)) for _ in range(b)]
        out["min_p"] = torch.tensor(mps, **f32)
    if cfg.get("violation") == "temperature_shape":
        out["temperature"] = torch.ones(b + 1, **f32)
    return out


def _penalties(cfg: dict, hrng: random.Random, hot: list, device) -> dict:
    """vLLM's penalty state per slot (prompt bits, output counts and bits) and per-row values;
    output tokens include rows' strong tokens so that the penalties change the draws."""
    b, v, slots = cfg["batch"], cfg["vocab"], cfg["num_slots"]
    prompt = torch.full((slots, 64), v, dtype=torch.int64)
    outputs = []
    for s in range(slots):
        n = hrng.randint(0, 64)
        prompt[s, :n] = torch.tensor([hrng.randrange(v) for _ in range(n)], dtype=torch.int64)
        ids = [hrng.randrange(v) for _ in range(hrng.randint(0, 40))]
        outputs.append(ids + hot[s % b][: hrng.randint(0, 3)] * hrng.randint(1, 3))
    pm, oc, om = sampling_state.penalty_state_from_v1(prompt.to(device), outputs, v)
    out = dict(
        prompt_bin_mask=pm, output_bin_counts=oc, output_bin_mask=om if cfg["out_mask"] else None
    )
    f32 = dict(dtype=torch.float32, device=device)
    kinds = cfg["penalties"]
    if kinds in ("rep", "all"):
        vals = [hrng.choice((1.0, hrng.uniform(0.5, 2.0))) for _ in range(b)]
        out["repetition_penalty"] = torch.tensor(vals, **f32)
    if kinds in ("freq+pres", "all"):
        for name in ("frequency_penalty", "presence_penalty"):
            vals = [hrng.choice((0.0, hrng.uniform(-1.0, 1.0))) for _ in range(b)]
            out[name] = torch.tensor(vals, **f32)
    return out


def _bias(cfg: dict, hrng: random.Random, device) -> dict:
    """V2's padded per-slot lists: duplicates add up, -inf bans (min_tokens), and entries past
    each slot's count hold garbage the kernel must not read."""
    slots, v = cfg["num_slots"], cfg["vocab"]
    width = cfg["bias_width"]
    counts = [hrng.randint(0, width) for _ in range(slots)]
    ids = [[hrng.randrange(v) for _ in range(width)] for _ in range(slots)]
    vals = [[hrng.choice((float("-inf"), hrng.gauss(0, 5))) if hrng.random() < 0.1
             else hrng.gauss(0, 5) for _ in range(width)] for _ in range(slots)]  # fmt: skip
    return dict(
        logit_bias_counts=torch.tensor(counts, dtype=torch.int32, device=device),
        logit_bias_token_ids=torch.tensor(ids, dtype=torch.int32, device=device),
        logit_bias_values=torch.tensor(vals, dtype=torch.float32, device=device),
    )


def _params(cfg: dict, hrng: random.Random, hot: list, device) -> smp.SamplingParamsTensors:
    b = cfg["batch"]
    kw = _rows(cfg, hrng, device)
    if cfg["penalties"]:
        kw.update(_penalties(cfg, hrng, hot, device))
    if cfg["bias"]:
        kw.update(_bias(cfg, hrng, device))
    if cfg["slots"]:
        dtype = torch.int32 if cfg["slots"] == "int32" else torch.int64
        ids = [hrng.randrange(cfg["num_slots"]) for _ in range(b)]
        kw["state_slots"] = torch.tensor(ids, dtype=dtype, device=device)
    if cfg["seed_mode"] != "none":
        seeds = [hrng.randint(-(2**63), 2**63 - 1) for _ in range(b)]
        kw["seeds"] = torch.tensor(seeds, dtype=torch.int64, device=device)
    if cfg["seed_mode"] == "mixed":
        kw["has_seed"] = torch.tensor([hrng.random() < 0.5 for _ in range(b)], device=device)
    if cfg["offsets"]:
        offsets = [hrng.randint(0, 2**40) for _ in range(b)]
        kw["seed_offsets"] = torch.tensor(offsets, dtype=torch.int64, device=device)
    violation = cfg.get("violation")
    if violation == "has_seed_without_seeds":
        kw.pop("seeds", None)
        kw["has_seed"] = torch.ones(b, dtype=torch.bool, device=device)
    elif violation == "penalty_without_masks":
        kw.update(repetition_penalty=torch.ones(b, device=device), prompt_bin_mask=None)
    elif violation == "bias_without_counts":
        kw.update(logit_bias_counts=None, logit_bias_values=torch.zeros(b, 2, device=device))
    return smp.SamplingParamsTensors(**kw)


def _workspace(cfg: dict, device) -> smp.SamplingWorkspace | None:
    """The case's workspace with every output poisoned, so that a value the kernel forgot to
    write fails the comparison."""
    spec = cfg["workspace"]
    if spec is None:
        return None
    chunk, cap = cfg["chunk"] or (None, smp.CAP)
    batch = 1 if cfg.get("violation") == "workspace_small" else spec["max_batch"]
    ws = smp.SamplingWorkspace.allocate(
        batch, spec["vocab"], device, max_logprobs=spec["max_logprobs"], chunk=chunk, cap=cap,
        arith=cfg["arith"],
    )  # fmt: skip
    for t in (ws.logprob, ws.topn_logprobs, ws.kept_threshold):
        t.fill_(float("nan"))
    for t in (ws.token_ids, ws.topn_ids, ws.nan_rows, ws.kept_count, ws.fallback_rows):
        t.fill_(-7)
    return ws


# ----------------------------------------------------------------------------------------------
# A case
# ----------------------------------------------------------------------------------------------


def run(cfg: dict, device: torch.device, check: bool = True) -> dict:
    gen = generator(device, cfg["tensor_seed"])
    hrng = random.Random(cfg["tensor_seed"])
    logits, hot = _logits(cfg, gen, hrng, device)
    if cfg.get("violation") == "logits_dtype":
        logits = logits.double()
    prm = _params(cfg, hrng, hot, device)
    ws = _workspace(cfg, device)
    n = 129 if cfg.get("violation") == "num_logprobs" else cfg["num_logprobs"]
    mode = "logits" if cfg.get("violation") == "logprobs_mode" else cfg["mode"]
    given = logits.clone()  # what the kernel gets: it may write penalized values into it
    torch.manual_seed(cfg["tensor_seed"])  # unseeded rows draw from torch's generator
    out = call_kernel(
        smp.fused_sample, given, prm, workspace=ws, num_logprobs=n, logprobs_mode=mode,
        logits_writable=cfg["writable"],
    )  # fmt: skip
    if "violation" in cfg or not check:
        return {}
    return check_case(cfg, logits, given, prm, out, hrng)


FAMILY = Family(
    name="sampling",
    profiles=profiles,
    draw=draw,
    run=run,
    expected_refusal=expected_refusal,
    kernel_modules=("fuselane.kernels.sampling.chunk", "fuselane.kernels.sampling.combine"),
    # full: ~9 compiled variants per profile, ~1.1 s each with 16 compile threads (the two
    # kernels are large): 80 variants over 10,000 cases in 89 s on an H100, 2026-11-26
    default_profiles={"full": 9, "small": 6, "sanitizer": 9},
    finish=distribution_check,
)

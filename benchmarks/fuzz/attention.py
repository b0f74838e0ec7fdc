"""The attention family: `paged_attention` (and the unchecked entry with its replay of a second
layer) against `paged_attention_reference` on random batches.

A profile fixes what the kernels compile for: (Hq, Hkv), head size, KV block size, q dtype,
cache dtype, sliding window, soft cap and sinks on or off. A case draws the batch around it:
ragged query lengths (empty, decode, speculative verify 2-8, prefill chunks, mixed), context
lengths across page boundaries, CUDA-graph padding rows, cache layout (K and V as views of one
tensor, slot- or head-major), q as a view of a fused QKV output, workspace or none, stale
max_query_len, and the entry point. Everything the kernel must not read is NaN (null block,
spare blocks, slots past each sequence's end), `out` is NaN before the call and must stay NaN
past cu_seqlens_q[-1] and outside its view.
"""

from __future__ import annotations

import math
import random

import torch

from fuselane.benchmarks.fuzz.core import (
    Family,
    Mismatch,
    assert_close,
    call_kernel,
    covering,
    generator,
    log_uniform,
    poison_,
    start_case,
)
from fuselane.kernels import attention as attn
from fuselane.kernels._checks import FP8_E4M3

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# q dtype -> (atol, rtol) against the fp32 reference: the kernel tests' table (the softmax
# weights are rounded to q's dtype before P @ V, the output once).
TOLERANCES = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}
# (Hq, Hkv) besides Llama-3-8B's (32, 8): MHA, MQA, odd head counts and GQA groups (7, and 8
# with an odd Hkv), the largest group (128). A pool of 1 + 8 profiles holds each once.
HEADS = {
    "full": [(8, 8), (4, 1), (28, 4), (6, 3), (5, 1), (40, 5), (128, 1), (64, 8)],
    "small": [(4, 1), (2, 2), (6, 3), (3, 1), (4, 2)],
    "sanitizer": [(32, 8), (4, 1), (6, 3), (5, 1), (8, 8), (28, 4)],
}  # fmt: skip
# The window is a compile-time constant of the kernels: a few values per run.
WINDOWS = {
    "full": [None, None, None, 1, 128, 1000, 4096],
    "small": [None, None, 1, 16],
    "sanitizer": [None, None, 64, 1000],
}
# Per scale: sequences, prefill sequences, longest chunk, longest context, and element budgets
# (K+V elements; one sequence's and the batch's query x key x head scores in the reference).
LIMITS = {
    "full": dict(seqs=64, prefills=8, chunk=2048, ctx=16384, kv=2**28, score=2**27,
                 scores=2**29, pad=8, splits=(1, 2, 4, 16, 64)),
    "small": dict(seqs=3, prefills=2, chunk=24, ctx=160, kv=2**18, score=2**14, scores=2**16,
                  pad=3, splits=(1, 2, 4)),
    "sanitizer": dict(seqs=16, prefills=3, chunk=512, ctx=2048, kv=2**24, score=2**22,
                      scores=2**24, pad=4, splits=(1, 4, 16)),
}  # fmt: skip
KINDS = ("decode", "spec", "prefill", "mixed", "empty")
KIND_WEIGHTS = (3, 2, 2, 3, 0.2)
# Out-of-contract configurations: (violation, the argument its refusal names).
VIOLATIONS = {
    "head_size": "head_size",
    "block_size": "block_size",
    "gqa_group": "num_q_heads",
    "gqa_max": "num_q_heads",
    "kv_dtype": "key_cache",
    "fp8_without_scales": "k_scale",
    "sliding_window": "sliding_window",
    "softcap": "softcap",
    "scale": "scale",
    "sinks": "sinks",
    "min_query_len": "min_query_len",
    "cu_seqlens_q": "cu_seqlens_q",
    "block_table": "block_table",
}


def profiles(rng: random.Random, count: int, scale: str) -> list[dict]:
    """A plain Llama-3-8B layer first (what vLLM runs most, and on sm_90 what Hopper's
    warp-specialized kernels take), then `count - 1` profiles covering the choices."""
    first = dict(
        heads=[4, 1] if scale == "small" else [32, 8], head_size=128, block_size=16,
        q_dtype="bfloat16", kv="same", window=None, softcap=False, sinks=False,
    )  # fmt: skip
    rest = covering(
        rng,
        count - 1,
        dict(
            heads=[list(h) for h in HEADS[scale]],
            head_size=list(attn.SUPPORTED_HEAD_SIZES),
            block_size=list(attn.SUPPORTED_BLOCK_SIZES),
            q_dtype=list(DTYPES),
            kv=["same", "same", "fp8"],
            window=WINDOWS[scale],
            softcap=[False, False, True],
            sinks=[False, False, True],
        ),
    )
    return [first, *rest]


def _q_lens(rng: random.Random, kind: str, lim: dict) -> list[int]:
    if kind == "empty":
        return [0] * rng.randint(1, 4)
    if kind == "decode":
        q = [1] * log_uniform(rng, 1, lim["seqs"])
    elif kind == "spec":
        width = rng.randint(2, 8)
        q = [width if rng.random() < 0.7 else rng.randint(1, width)
             for _ in range(log_uniform(rng, 1, lim["seqs"]))]  # fmt: skip
    elif kind == "prefill":
        q = [log_uniform(rng, 9, lim["chunk"]) for _ in range(log_uniform(rng, 1, lim["prefills"]))]
    else:  # mixed: empty, decode, verify and prefill rows in one batch
        q, prefills = [], 0
        for _ in range(log_uniform(rng, 2, max(2, lim["seqs"]))):
            pick = rng.choices(("0", "1", "spec", "prefill"), weights=(1, 4, 2, 3))[0]
            if pick == "prefill" and prefills < lim["prefills"]:
                prefills += 1
                q.append(log_uniform(rng, 9, lim["chunk"]))
            else:
                q.append({"0": 0, "1": 1}.get(pick, rng.randint(2, 8)))
    if rng.random() < 0.2:  # CUDA-graph padding requests (no query, no context) among them
        for i in rng.sample(range(len(q)), k=rng.randint(1, len(q))):
            q[i] = 0
    return q


def _seq_len(rng: random.Random, q: int, block: int, lim: dict) -> int:
    """KV length of a sequence with `q` query tokens: no prefix, any prefix, or one ending at,
    just before or just after a page boundary."""
    if q == 0:
        return 0 if rng.random() < 0.8 else log_uniform(rng, 1, 200)
    r = rng.random()
    if r < 0.25 or q >= lim["ctx"]:
        return q
    if r < 0.8:
        return q + log_uniform(rng, 1, lim["ctx"] - q)
    pages = rng.randint(max(1, q // block), max(1, lim["ctx"] // block))
    return max(q, pages * block + rng.choice((-1, 0, 1)))


def _fit(q_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, lim: dict) -> None:
    """Shrink the largest sequences (prefix first, then query) until the batch fits the
    element budgets: the reference materializes every (query, key, head) score in fp32."""

    def over() -> int | None:
        scores = [q * s * hq for q, s in zip(q_lens, seq_lens, strict=True)]
        if sum(seq_lens) * hkv * d * 2 > lim["kv"]:
            return max(range(len(seq_lens)), key=seq_lens.__getitem__)
        if sum(scores) > lim["scores"] or max(scores, default=0) > lim["score"]:
            return max(range(len(scores)), key=scores.__getitem__)
        return None

    while (i := over()) is not None:
        q, s = q_lens[i], seq_lens[i]
        if s > q:
            seq_lens[i] = q + (s - q) // 2
        else:
            q_lens[i] = seq_lens[i] = q // 2


def draw(rng: random.Random, pool: list[dict], scale: str) -> dict:
    cfg, invalid = start_case(rng, pool)
    lim = LIMITS[scale]
    if invalid:
        return _invalid(rng, cfg)
    hq, hkv = cfg["heads"]
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    q_lens = _q_lens(rng, kind, lim)
    seq_lens = [_seq_len(rng, q, cfg["block_size"], lim) for q in q_lens]
    _fit(q_lens, seq_lens, hq, hkv, cfg["head_size"], lim)
    live = [q for q in q_lens if q]
    big_logits = cfg["softcap"] and rng.random() < 0.5  # so that the cap changes the result
    workspace = None
    if rng.random() < 0.8:
        rows = rng.randint(1, max(1, 16 * len(q_lens)))
        splits = rng.choice(lim["splits"])
        head_pad = 1 << (cfg["head_size"] - 1).bit_length()
        while splits > 1 and rows * hq * splits * head_pad > 2**26:
            splits //= 2
        workspace = {"rows": rows, "max_splits": splits}
    cfg.update(
        kind=kind,
        q_lens=q_lens,
        seq_lens=seq_lens,
        # a captured CUDA graph's batch may be larger than this one's longest query
        max_query_len=max(q_lens, default=0) + (rng.randint(1, 16) if rng.random() < 0.1 else 0),
        min_query_len=min(live) if live and rng.random() < 0.3 else 0,
        pad_rows=rng.randint(1, lim["pad"]) if rng.random() < 0.7 else 0,
        layout=rng.choice(("nhd", "hnd")),
        q_view=rng.choice(("qkv", "contiguous")),
        out_view=rng.choice(("contiguous", "wide")),
        extra_cols=rng.randint(0, 3),
        spare_blocks=rng.randint(1, 3),
        scale=1.0 if big_logits else rng.uniform(0.5, 2.0) / math.sqrt(cfg["head_size"]),
        softcap=rng.uniform(2.0, 50.0) if cfg["softcap"] else 0.0,
        k_scale=rng.uniform(0.1, 1.0),
        v_scale=rng.uniform(0.1, 1.0),
        workspace=workspace,
        entry=rng.choices(("paged_attention", "paged_attention_unchecked"), (7, 3))[0],
        tensor_seed=rng.getrandbits(62),
    )
    return cfg


def _invalid(rng: random.Random, cfg: dict) -> dict:
    """A small batch with one argument out of contract (checked entry: the unchecked one
    checks nothing by design)."""
    violation = rng.choice(sorted(VIOLATIONS))
    cfg.update(violation=violation, kind="invalid", q_lens=[1, 5], seq_lens=[10, 5],
               max_query_len=5, min_query_len=0, pad_rows=1, layout="nhd", q_view="contiguous",
               out_view="contiguous", extra_cols=0, spare_blocks=1, scale=0.125,
               softcap=1.0 if cfg["softcap"] else 0.0, k_scale=0.5, v_scale=0.5, workspace=None,
               entry="paged_attention", tensor_seed=rng.getrandbits(62))  # fmt: skip
    if violation == "head_size":
        cfg["head_size"] = rng.choice((32, 112, 192, 512))
    elif violation == "block_size":
        cfg["block_size"] = rng.choice((8, 128))
    elif violation == "gqa_group":
        cfg["heads"] = [6, 4]
    elif violation == "gqa_max":
        cfg["heads"] = [256, 1]
    elif violation == "kv_dtype":
        cfg["kv"] = "other"
    elif violation == "fp8_without_scales":
        cfg["kv"] = "fp8"
    elif violation == "sliding_window":
        cfg["window"] = 0
    elif violation == "softcap":
        cfg["softcap"] = -1.0
    elif violation == "scale":
        cfg["scale"] = rng.choice((0.0, -0.1, math.inf))
    elif violation == "min_query_len":
        cfg["min_query_len"] = 6
    return cfg


def expected_refusal(cfg: dict) -> str | None:
    violation = cfg.get("violation")
    return None if violation is None else VIOLATIONS[violation]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _kv_dtype(cfg: dict) -> torch.dtype:
    q_dtype = DTYPES[cfg["q_dtype"]]
    if cfg["kv"] == "fp8":
        return FP8_E4M3
    if cfg["kv"] == "other":
        return torch.bfloat16 if q_dtype == torch.float16 else torch.float16
    return q_dtype


def _pages(cfg: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block_table [B, max_pages + extra] int32, poison [blocks, slots] bool, blocks): pages in
    a random order after the null block 0; unused entries point at the null block; the null
    block, the spare blocks and the slots past each sequence's end are poison (CPU tensors)."""
    bs, seq_lens = cfg["block_size"], cfg["seq_lens"]
    pages = [-(-s // bs) for s in seq_lens]
    blocks = 1 + sum(pages) + cfg["spare_blocks"]
    order = list(range(1, 1 + sum(pages)))
    random.Random(cfg["tensor_seed"]).shuffle(order)
    table = torch.zeros(len(seq_lens), max(pages, default=0) + cfg["extra_cols"], dtype=torch.int32)
    poison = torch.zeros(blocks, bs, dtype=torch.bool)
    poison[0] = True
    poison[blocks - cfg["spare_blocks"] :] = True
    used = 0
    for b, (n, s) in enumerate(zip(pages, seq_lens, strict=True)):
        if n:
            phys = order[used : used + n]
            used += n
            table[b, :n] = torch.tensor(phys, dtype=torch.int32)
            poison[phys[-1], s - (n - 1) * bs :] = True
    return table, poison, blocks


def _layer(cfg: dict, gen: torch.Generator, poison: torch.Tensor, blocks: int, device) -> dict:
    """One layer's q, caches (views of one poisoned KV tensor), sinks and scales."""
    hq, hkv = cfg["heads"]
    d, bs = cfg["head_size"], cfg["block_size"]
    q_dtype, kv_dtype = DTYPES[cfg["q_dtype"]], _kv_dtype(cfg)
    nhd = cfg["layout"] == "nhd"
    shape = (blocks, bs, hkv, 2 * d) if nhd else (blocks, hkv, bs, 2 * d)
    mask = (poison[:, :, None, None] if nhd else poison[:, None, :, None]).to(device).expand(shape)
    if kv_dtype == FP8_E4M3:  # e4m3 codes spread over [-8, 8]
        base = torch.randn(shape, generator=gen, device=device, dtype=torch.float16) * 2.0
        base = base.to(FP8_E4M3)
    else:
        base = torch.randn(shape, generator=gen, device=device, dtype=kv_dtype)
    poison_(base, mask)
    key_cache, value_cache = (base if nhd else base.transpose(1, 2)).split(d, dim=-1)
    rows = sum(cfg["q_lens"]) + cfg["pad_rows"]
    if cfg["q_view"] == "qkv":  # q as vLLM gets it: a view of the fused QKV projection
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen, device=device, dtype=q_dtype)
        q = qkv[:, : hq * d].view(rows, hq, d)
    else:
        q = torch.randn(rows, hq, d, generator=gen, device=device, dtype=q_dtype)
    layer = dict(q=q, key_cache=key_cache, value_cache=value_cache)
    if cfg.get("violation") == "sinks":
        layer["sinks"] = torch.zeros(hq + 1, device=device)
    elif cfg["sinks"]:
        layer["sinks"] = torch.randn(hq, generator=gen, device=device) * 3.0
    if cfg["kv"] == "fp8" and cfg.get("violation") != "fp8_without_scales":
        layer["k_scale"] = torch.tensor([cfg["k_scale"]], device=device)
        layer["v_scale"] = torch.tensor([cfg["v_scale"]], device=device)
    return layer


def _out(cfg: dict, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the NaN buffer it views): contiguous, or every row wider than out's heads."""
    rows, hq, d = q.shape
    wide = cfg["out_view"] == "wide"
    base = torch.full((rows, hq + wide, d), float("nan"), dtype=q.dtype, device=q.device)
    return base[:, :hq], base


def _metadata(cfg: dict, table: torch.Tensor, device) -> dict:
    cu = [0]
    for q in cfg["q_lens"]:
        cu.append(cu[-1] + q)
    violation = cfg.get("violation")
    return dict(
        cu_seqlens_q=torch.tensor(
            cu, dtype=torch.int64 if violation == "cu_seqlens_q" else torch.int32, device=device
        ),
        seq_lens=torch.tensor(cfg["seq_lens"], dtype=torch.int32, device=device),
        block_table=table.to(device, torch.int64 if violation == "block_table" else torch.int32),
        max_query_len=cfg["max_query_len"],
        max_seq_len=max(cfg["seq_lens"], default=0),
        min_query_len=cfg["min_query_len"],
        scale=cfg["scale"],
        sliding_window=cfg["window"],
        softcap=cfg["softcap"],
    )


# ----------------------------------------------------------------------------------------------
# A case
# ----------------------------------------------------------------------------------------------


def run(cfg: dict, device: torch.device, check: bool = True) -> dict:
    gen = generator(device, cfg["tensor_seed"])
    table, poison, blocks = _pages(cfg)
    meta = _metadata(cfg, table, device)
    ws = None
    if cfg["workspace"] is not None:
        hq, d = cfg["heads"][0], cfg["head_size"]
        ws = attn.AttentionWorkspace.allocate(
            cfg["workspace"]["rows"], hq, d, device, max_splits=cfg["workspace"]["max_splits"]
        )
    entry = getattr(attn, cfg["entry"])  # looked up per call: a test may replace it
    # The unchecked entry replays its first call's launches for the next layer's tensors
    # (vLLM's layers after the first): a second layer checks the replay.
    layers = 2 if cfg["entry"] == "paged_attention_unchecked" and check else 1
    try:
        for n in range(layers):
            layer = _layer(cfg, gen, poison, blocks, device)
            if not check:
                out, _ = _out(cfg, layer["q"])
                call_kernel(entry, out=out, **layer, **meta, workspace=ws)
                return {}
            _check_layer(cfg, entry, layer, meta, ws, f"layer {n}: " if layers > 1 else "")
    finally:
        attn.LAUNCHES.clear()  # its entries keep this case's tensors alive
    return {} if "violation" in cfg else _stats(cfg, layer, ws)


def _check_layer(cfg: dict, entry, layer: dict, meta: dict, ws, where: str) -> None:
    q = layer["q"]
    out, out_base = _out(cfg, q)
    result = call_kernel(entry, out=out, **layer, **meta, workspace=ws)
    if "violation" in cfg:
        return  # accepted: the case loop reports it
    expected = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    attn.paged_attention_reference(out=expected, **layer, **meta)
    if result is not out:
        raise Mismatch(f"{where}the entry point returned another tensor than out")
    rows = sum(cfg["q_lens"])
    atol, rtol = TOLERANCES[q.dtype]
    assert_close(out[:rows], expected[:rows], atol, rtol, f"{where}out")
    padding = out[rows:]
    if not torch.isnan(padding).all():
        first = int((~torch.isnan(padding)).nonzero()[0, 0]) + rows
        raise Mismatch(f"{where}out row {first} past cu_seqlens_q[-1] = {rows} was written")
    if cfg["out_view"] == "wide" and not torch.isnan(out_base[:, q.shape[1] :]).all():
        raise Mismatch(f"{where}written outside out's view (the buffer's spare head)")
    if ws is not None and int(ws.counters.abs().sum()) != 0:
        raise Mismatch(f"{where}split counters not back at zero after the call")


def _stats(cfg: dict, layer: dict, ws) -> dict:
    """What the case covered, counted over the run: batch kind, entry point, options, and the
    launch plan the rule chose (decode only or with prefill, split, Hopper kernels)."""
    stats = {f"kind:{cfg['kind']}": 1, f"entry:{cfg['entry']}": 1, f"kv:{cfg['kv']}": 1,
             "workspace": int(ws is not None), "window": int(cfg["window"] is not None),
             "softcap": int(bool(cfg["softcap"])), "sinks": int(cfg["sinks"]),
             "padding_rows": int(cfg["pad_rows"] > 0), "query_rows": sum(cfg["q_lens"]),
             "kv_tokens": sum(cfg["seq_lens"])}  # fmt: skip
    q, key_cache, value_cache = layer["q"], layer["key_cache"], layer["value_cache"]
    if sum(cfg["q_lens"]):  # the plan `_run` makes (the same inputs to `plan_launch`)
        hopper = attn.warp_specialized_ok(q, key_cache, value_cache)
        plan = attn.plan_launch(
            num_seqs=len(cfg["seq_lens"]), num_q_heads=q.shape[1],
            num_kv_heads=key_cache.shape[2], head_size=q.shape[2],
            max_query_len=cfg["max_query_len"], sms=attn.sm_count(q.device), workspace=ws,
            kv_bytes=key_cache.element_size(), max_smem=attn.smem_per_block(q.device),
            warp_specialized=hopper,
        )  # fmt: skip
        stats["plan:prefill" if plan.prefill else "plan:decode_only"] = 1
        stats["plan:split"] = int(plan.decode.num_splits > 1)
        stats["plan:balanced"] = int(plan.decode.split_budget > 0)
        stats["plan:hopper"] = int(
            plan.decode.warp_specialized or bool(plan.prefill and plan.prefill.warp_specialized)
        )
    return stats


FAMILY = Family(
    name="attention",
    profiles=profiles,
    draw=draw,
    run=run,
    expected_refusal=expected_refusal,
    kernel_modules=tuple(
        f"fuselane.kernels.attention.{m}" for m in ("decode", "prefill", "decode_ws", "prefill_ws")
    ),
    # full: ~25 compiled variants per profile (the plan rule's variants of each head
    # configuration, with and without workspace), ~0.5 s each with 16 compile threads: 224
    # variants over 6,500 cases in 111 s on an H100, 2026-11-26
    default_profiles={"full": 9, "small": 6, "sanitizer": 9},
)

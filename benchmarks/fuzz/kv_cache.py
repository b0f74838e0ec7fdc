"""The KV-cache family: `kv_cache_update` (checked, and unchecked with its replay of a second
layer) and the fused `rope_kv_cache_update` against their torch references.

A profile fixes what the kernels compile for: Hkv (and Hq for RoPE), head size, block size,
input and cache dtypes (fp8 e4m3 with scales), the operation, rotary width and style (neox or
gpt-j), cos/sin dtype, slot dtype and the cache layout (vLLM's combined KV tensor slot- or
head-major, heads outermost, two layers interleaved, two separate tensors). A case draws the
tokens (0 to ~8k), a slot mapping with padding slots and fewer entries than key rows, the
input layout (views of a fused QKV output, padded heads, contiguous), magnitudes that saturate
fp8, scales (one element or 0-d) and positions. Caches are NaN before the call and compared
whole and bit for bit with the reference's, as the kernel tests do; rotated q and k within
rounding of the fp32 reference, their pass-through dims and value untouched.
"""

from __future__ import annotations

import random

import torch

from fuselane.benchmarks.fuzz.core import (
    Family,
    assert_bitwise,
    assert_close,
    call_kernel,
    covering,
    generator,
    log_uniform,
    log_uniform_float,
    poison_,
    start_case,
)
from fuselane.kernels import kv_cache as kvc
from fuselane.kernels._checks import FP8_E4M3

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Rotated q / k against the fp32 reference (tests/allclose.py's table): the interpreter rounds
# fp32 -> bf16 toward zero and a GPU may contract to FMA, one ulp either way.
TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2),
              torch.float32: (1e-5, 1e-5)}  # fmt: skip
KV_HEADS = {"full": [1, 2, 3, 4, 5, 8, 16], "small": [1, 2, 3], "sanitizer": [1, 3, 8]}
GROUPS = {"full": [1, 2, 4, 5, 8], "small": [1, 2], "sanitizer": [1, 4]}
CACHE_LAYOUTS = ("nhd", "hnd", "heads_outer", "layers", "separate")
INPUT_LAYOUTS = ("qkv", "padded_heads", "contiguous")
# Per scale: most tokens, and elements of q + k + v (the rest shrinks the tokens).
LIMITS = {
    "full": dict(tokens=8192, elems=2**27),
    "small": dict(tokens=40, elems=2**16),
    "sanitizer": dict(tokens=1024, elems=2**22),
}
# Token counts at the launch rule's bounds (rows per program change past 512 and 2048).
EDGE_TOKENS = (0, 1, 2, 511, 512, 513, 2048, 2049)
VIOLATIONS = {  # violation -> (operation, the argument its refusal names)
    "head_size": ("write", "head_size"),
    "block_size": ("write", "block_size"),
    "slot_mapping_longer": ("write", "slot_mapping"),
    "slot_dtype": ("write", "slot_mapping"),
    "cache_dtype": ("write", "key_cache"),
    "value_dtype": ("write", "value"),
    "fp8_without_scale": ("write", "k_scale"),
    "scale_shape": ("write", "k_scale"),
    "rot_dim_odd": ("rope", "cos_sin_cache"),
    "rot_dim_wide": ("rope", "cos_sin_cache"),
    "positions": ("rope", "positions"),
    "is_neox": ("rope", "is_neox"),
    "query_dtype": ("rope", "query"),
}


def profiles(rng: random.Random, count: int, scale: str) -> list[dict]:
    """vLLM's default for Llama-3-8B first (bf16 into a bf16 NHD cache), then `count - 1`
    profiles covering the choices."""
    first = dict(kv_heads=1 if scale == "small" else 8, group=4, head_size=128, block_size=16,
                 dtype="bfloat16", cache="same", op="write", rot="full", neox=True,
                 cos_sin_dtype="bfloat16", slot_dtype="int64", layout="nhd")  # fmt: skip
    rest = covering(
        rng,
        count - 1,
        dict(
            kv_heads=KV_HEADS[scale],
            group=GROUPS[scale],
            head_size=list(kvc.SUPPORTED_HEAD_SIZES),
            block_size=list(kvc.SUPPORTED_BLOCK_SIZES),
            dtype=list(DTYPES),
            cache=["same", "same", "fp8"],
            op=["write", "write", "rope"],
            rot=["full", "half", "quarter"],
            neox=[True, False],
            cos_sin_dtype=list(DTYPES),
            slot_dtype=["int64", "int32"],
            layout=list(CACHE_LAYOUTS),
        ),
    )
    return [first, *rest]


def _rot_dim(cfg: dict) -> int:
    d = cfg["head_size"]
    return {"full": d, "half": d // 2, "quarter": d // 4}[cfg["rot"]]


def draw(rng: random.Random, pool: list[dict], scale: str) -> dict:
    cfg, invalid = start_case(rng, pool)
    lim = LIMITS[scale]
    if invalid:
        return _invalid(rng, cfg)
    edges = [t for t in EDGE_TOKENS if t <= lim["tokens"]]
    tokens = rng.choice(edges) if rng.random() < 0.1 else log_uniform(rng, 1, lim["tokens"])
    heads = cfg["kv_heads"] * (2 + (cfg["group"] if cfg["op"] == "rope" else 0))
    tokens = min(tokens, lim["elems"] // (heads * (cfg["head_size"] + 16)))
    # vLLM V1 pads key for CUDA graphs and passes the unpadded slot mapping
    short = rng.randint(1, min(tokens, 8)) if tokens and rng.random() < 0.3 else 0
    cfg.update(
        tokens=tokens,
        rows=tokens - short,
        pad_fraction=rng.choice((0.0, 0.0, 0.05, 0.3, 1.0)),
        spare_blocks=rng.randint(1, 4),
        input_layout=rng.choice(INPUT_LAYOUTS),
        magnitude=rng.choice((1.0, 3.0, 30.0)),
        k_scale=log_uniform_float(rng, 0.005, 2.0),
        v_scale=log_uniform_float(rng, 0.005, 2.0),
        zero_dim_scale=rng.random() < 0.3,
        max_position=log_uniform(rng, 1, 8192),
        entry=rng.choice(("kv_cache_update", "kv_cache_update_unchecked")),
        tensor_seed=rng.getrandbits(62),
    )
    if cfg["op"] == "rope":
        cfg["entry"] = "rope_kv_cache_update"
    return cfg


def _invalid(rng: random.Random, cfg: dict) -> dict:
    violation = rng.choice(sorted(VIOLATIONS))
    op, _ = VIOLATIONS[violation]
    cfg.update(violation=violation, op=op, tokens=6, rows=6, pad_fraction=0.0, spare_blocks=1,
               input_layout="contiguous", magnitude=1.0, k_scale=0.5, v_scale=0.5,
               zero_dim_scale=False, max_position=16,
               entry="kv_cache_update" if op == "write" else "rope_kv_cache_update",
               tensor_seed=rng.getrandbits(62))  # fmt: skip
    if violation == "head_size":
        cfg["head_size"] = rng.choice((48, 512))
    elif violation == "block_size":
        cfg["block_size"] = rng.choice((8, 128))
    elif violation in ("fp8_without_scale", "scale_shape"):
        cfg["cache"] = "fp8"
    elif violation == "cache_dtype":
        cfg["cache"] = "other"
    return cfg


def expected_refusal(cfg: dict) -> str | None:
    violation = cfg.get("violation")
    return None if violation is None else VIOLATIONS[violation][1]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _cache_dtype(cfg: dict) -> torch.dtype:
    dtype = DTYPES[cfg["dtype"]]
    if cfg["cache"] == "fp8":
        return FP8_E4M3
    if cfg["cache"] == "other":
        return torch.float16 if dtype != torch.float16 else torch.bfloat16
    return dtype


def _cache(cfg: dict, blocks: int, device) -> torch.Tensor:
    """The poisoned base tensor behind `_views` (the kernel tests' layouts)."""
    bs, h, d = cfg["block_size"], cfg["kv_heads"], cfg["head_size"]
    shape = {
        "nhd": (blocks, bs, h, 2 * d),  # vLLM's default: K and V interleave per head
        "hnd": (blocks, h, bs, 2 * d),
        "heads_outer": (h, blocks, bs, 2 * d),
        "layers": (blocks, 2, bs, h, 2 * d),  # two layers' pages interleave; this is layer 1
        "separate": (2, blocks, bs, h, d),
    }[cfg["layout"]]
    base = torch.empty(shape, dtype=_cache_dtype(cfg), device=device)
    poison_(base)
    return base


def _views(cfg: dict, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each [blocks, block_size, Hkv, D], as views of `base`."""
    layout, d = cfg["layout"], cfg["head_size"]
    if layout == "separate":
        return base[0], base[1]
    if layout == "hnd":
        kv = base.transpose(1, 2)
    elif layout == "heads_outer":
        kv = base.permute(1, 2, 0, 3)
    elif layout == "layers":
        kv = base[:, 1]
    else:
        kv = base
    key_cache, value_cache = kv.split(d, dim=-1)
    return key_cache, value_cache


def _inputs(cfg: dict, gen: torch.Generator, device) -> tuple[list[torch.Tensor], list]:
    """([query, key, value] as [T, H, D] views in the case's input layout, their base tensors)."""
    t, d = cfg["tokens"], cfg["head_size"]
    hkv = cfg["kv_heads"]
    hq = hkv * cfg["group"]
    dtype = DTYPES[cfg["dtype"]]
    mag = cfg["magnitude"]

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * mag).to(dt)

    layout = cfg["input_layout"]
    if layout == "qkv":  # views of a fused QKV projection: row stride (Hq + 2 Hkv) D
        qkv = randn(t, (hq + 2 * hkv) * d)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        views = [q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)]
        bases = [qkv]
    elif layout == "padded_heads":  # head stride D + 16, token stride larger still
        bases = [randn(t, h + 1, d + 16) for h in (hq, hkv, hkv)]
        views = [b[:, :-1, :d] for b in bases]
    else:
        views = bases = [randn(t, h, d) for h in (hq, hkv, hkv)]
    if cfg.get("violation") == "value_dtype":
        views[2] = views[2].to(torch.float16 if dtype != torch.float16 else torch.float32)
    elif cfg.get("violation") == "query_dtype":
        views[0] = views[0].to(torch.float16 if dtype != torch.float16 else torch.float32)
    return views, bases


def _slots(cfg: dict, gen: torch.Generator, device) -> tuple[torch.Tensor, int]:
    """(slot_mapping, cache blocks): distinct slots in random blocks (the first and last slot
    of a block among them), a fraction replaced by padding values (-1, other negatives, and
    for int64 values whose low 32 bits are a valid slot)."""
    rows, bs = cfg["rows"], cfg["block_size"]
    blocks = -(-rows // bs) + cfg["spare_blocks"]
    hrng = random.Random(cfg["tensor_seed"])
    slots = hrng.sample(range(blocks * bs), rows)
    if rows >= 4:
        b = hrng.randrange(blocks)
        ends = [b * bs, b * bs + bs - 1]
        slots = ends + [s for s in slots if s not in ends][: rows - 2]
        hrng.shuffle(slots)
    int64 = cfg["slot_dtype"] == "int64"
    pads = [-1, -7] + ([-(1 << 32), -(1 << 32) + 5] if int64 else [])
    slots = [hrng.choice(pads) if hrng.random() < cfg["pad_fraction"] else s for s in slots]
    violation = cfg.get("violation")
    if violation == "slot_mapping_longer":
        slots += [0] * (cfg["tokens"] + 1 - rows)
    dtype = {"int64": torch.int64, "int32": torch.int32}[cfg["slot_dtype"]]
    if violation == "slot_dtype":
        dtype = torch.int16
    return torch.tensor(slots, dtype=dtype, device=device), blocks


def _scales(cfg: dict, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if cfg["cache"] != "fp8" or cfg.get("violation") == "fp8_without_scale":
        return None, None
    if cfg.get("violation") == "scale_shape":
        return torch.ones(2, device=device), torch.ones(1, device=device)
    shape = () if cfg["zero_dim_scale"] else (1,)
    k, v = (torch.full(shape, cfg[n], device=device) for n in ("k_scale", "v_scale"))
    return k, v


def _rotary(cfg: dict, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T], cos_sin_cache [max_position, rot_dim]) with random angles."""
    rot = _rot_dim(cfg) + {"rot_dim_odd": 1, "rot_dim_wide": cfg["head_size"]}.get(
        cfg.get("violation"), 0
    )
    half = (rot + 1) // 2
    angles = torch.rand(cfg["max_position"], half, generator=gen, device=device) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)[:, :rot]
    cos_sin = cos_sin.contiguous().to(DTYPES[cfg["cos_sin_dtype"]])
    n = cfg["tokens"] + (1 if cfg.get("violation") == "positions" else 0)
    positions = torch.randint(0, cfg["max_position"], (n,), generator=gen, device=device)
    return positions.to(torch.int64 if cfg["slot_dtype"] == "int64" else torch.int32), cos_sin


# ----------------------------------------------------------------------------------------------
# A case
# ----------------------------------------------------------------------------------------------


def run(cfg: dict, device: torch.device, check: bool = True) -> dict:
    gen = generator(device, cfg["tensor_seed"])
    slots, blocks = _slots(cfg, gen, device)
    scales = _scales(cfg, device)
    if cfg["op"] == "rope":
        _rope_case(cfg, gen, slots, blocks, scales, device, check)
    else:
        entry = getattr(kvc, cfg["entry"])  # looked up per call: a test may replace it
        # The unchecked write replays its first call's launch for the next layer's tensors.
        layers = 2 if cfg["entry"] == "kv_cache_update_unchecked" and check else 1
        try:
            for n in range(layers):
                where = f"layer {n}: " if layers > 1 else ""
                _write_case(cfg, entry, gen, slots, blocks, scales, device, where, check)
        finally:
            kvc.WRITE_LAUNCHES.clear()  # its entries keep this case's tensors alive
    if "violation" in cfg or not check:
        return {}
    return {f"op:{cfg['entry']}": 1, f"cache:{cfg['cache']}": 1, f"layout:{cfg['layout']}": 1,
            "tokens": cfg["tokens"], "padding_slots": int((slots < 0).sum()),
            "short_slot_mapping": int(cfg["rows"] < cfg["tokens"])}  # fmt: skip


def _write_case(cfg, entry, gen, slots, blocks, scales, device, where: str, check) -> None:
    (_, key, value), bases = _inputs(cfg, gen, device)
    before = [b.clone() for b in bases]
    base = _cache(cfg, blocks, device)
    want = base.clone()
    call_kernel(entry, key, value, *_views(cfg, base), slots, *scales)
    if "violation" in cfg or not check:
        return
    kvc.kv_cache_update_reference(key, value, *_views(cfg, want), slots, *scales)
    assert_bitwise(base, want, f"{where}cache ({cfg['layout']}) ")
    for b, b0 in zip(bases, before, strict=True):
        assert_bitwise(b, b0, f"{where}input buffer (written by the write) ")


def _rope_case(cfg, gen, slots, blocks, scales, device, check) -> None:
    (query, key, value), bases = _inputs(cfg, gen, device)
    positions, cos_sin = _rotary(cfg, gen, device)
    before = [b.clone() for b in bases]
    q0, k0, v0 = query.clone(), key.clone(), value.clone()
    ref_q, ref_k, ref_v = query.clone(), key.clone(), value.clone()
    base = _cache(cfg, blocks, device)
    args = (cfg["neox"] if cfg.get("violation") != "is_neox" else int(cfg["neox"]),)
    call_kernel(
        kvc.rope_kv_cache_update, positions, query, key, value, cos_sin, *args,
        *_views(cfg, base), slots, *scales,
    )  # fmt: skip
    if "violation" in cfg or not check:
        return
    ref_base = _cache(cfg, blocks, device)
    kvc.rope_kv_cache_update_reference(
        positions, ref_q, ref_k, ref_v, cos_sin, cfg["neox"], *_views(cfg, ref_base), slots,
        *scales,
    )  # fmt: skip
    atol, rtol = TOLERANCES[query.dtype]
    assert_close(query, ref_q, atol, rtol, "query ")
    assert_close(key, ref_k, atol, rtol, "key ")
    rot = _rot_dim(cfg)
    assert_bitwise(query[..., rot:], q0[..., rot:], "query pass-through dims ")
    assert_bitwise(key[..., rot:], k0[..., rot:], "key pass-through dims ")
    assert_bitwise(value, v0, "value ")
    if cfg["input_layout"] == "padded_heads":  # nothing outside the views written
        for b, b0 in zip(bases, before, strict=True):
            assert_bitwise(b[:, -1], b0[:, -1], "input buffer's spare head ")
            assert_bitwise(b[..., cfg["head_size"] :], b0[..., cfg["head_size"] :],
                           "input buffer's row padding ")  # fmt: skip
    # the cache: exactly what the plain write makes of the key as the kernel rotated it
    want = _cache(cfg, blocks, device)
    kvc.kv_cache_update_reference(key, value, *_views(cfg, want), slots, *scales)
    assert_bitwise(base, want, f"cache ({cfg['layout']}) ")


FAMILY = Family(
    name="kv_cache",
    profiles=profiles,
    draw=draw,
    run=run,
    expected_refusal=expected_refusal,
    kernel_modules=("fuselane.kernels.kv_cache.write", "fuselane.kernels.kv_cache.rope"),
    default_profiles={"full": 24, "small": 8, "sanitizer": 12},
)

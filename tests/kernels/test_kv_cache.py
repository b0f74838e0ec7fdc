"""kernels/kv_cache/: the Triton kernels against their torch references.

Runs under Triton's interpreter on the CPU, and on the GPU as it is (`tests.device.DEVICE`):
inputs are drawn on the CPU from seeded generators and moved to DEVICE, so both see the same
numbers, and on a GPU the compiled kernels (native fp8 cast, int32 offsets) are what is tested.
Every cache is poisoned (NaN; for fp8 the NaN byte 0x7F) before each call and compared whole and
bitwise with the reference's, so a slot written where it should not be, or not written where it
should, fails. Inputs are in the layouts vLLM passes: key/value views of a fused QKV output, K/V
caches that are strided views of one tensor.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from fuselane.kernels import kv_cache as kvc
from fuselane.kernels._checks import FP8_E4M3, FP8_E4M3_MAX
from fuselane.kernels.kv_cache import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    kv_cache_update,
    kv_cache_update_reference,
    quantize_e4m3_reference,
    rope_kv_cache_update,
    rope_kv_cache_update_reference,
    rotary_reference,
)
from tests.allclose import TOLERANCES, assert_close
from tests.device import DEVICE

FP8_NAN_BYTE = 0x7F
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (dtype, atol, rtol) for rotated q/k. The copy itself is compared bit for bit. Triton's
# interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so bf16 outputs
# differ from the reference by up to one bf16 ulp there; fp16 and fp32 match exactly there. On
# the GPU the fp32 math may contract to FMA: any dtype may then round one ulp away.
ROTARY_TOLERANCES = [(dt, *TOLERANCES[dt]) for dt in DTYPES]
INTERPRETING = kvc.checks._interpreting()
# Small tensors for the validation tests, on DEVICE unless a test asks for another device.
zeros = partial(torch.zeros, device=DEVICE)
arange = partial(torch.arange, device=DEVICE)
ones = partial(torch.ones, device=DEVICE)
tensor = partial(torch.tensor, device=DEVICE)
CACHE_LAYOUTS = ("nhd", "hnd", "heads_outer", "layers", "separate")
INPUT_LAYOUTS = ("qkv", "padded_heads", "contiguous")


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def cache_views(
    base: torch.Tensor, layout: str, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each [num_blocks, block_size, Hkv, D], as views of `base`."""
    if layout == "nhd":  # vLLM's default (LBNHC): [B, N, H, 2D], K and V interleave per head
        kv = base
    elif layout == "hnd":  # LBHNC: physical [B, H, N, 2D]
        kv = base.transpose(1, 2)
    elif layout == "heads_outer":  # LHBNC: physical [H, B, N, 2D], huge head stride
        kv = base.permute(1, 2, 0, 3)
    elif layout == "layers":  # BLNHC: two layers' pages interleave; this is layer 1
        kv = base[:, 1]
    elif layout == "separate":  # two plain contiguous tensors
        return base[0], base[1]
    else:
        raise AssertionError(layout)
    key_cache, value_cache = kv.split(head_size, dim=-1)
    return key_cache, value_cache


def make_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype, layout: str
) -> torch.Tensor:
    """The poisoned base tensor behind `cache_views(base, layout, head_size)`."""
    shape = {
        "nhd": (num_blocks, block_size, num_kv_heads, 2 * head_size),
        "hnd": (num_blocks, num_kv_heads, block_size, 2 * head_size),
        "heads_outer": (num_kv_heads, num_blocks, block_size, 2 * head_size),
        "layers": (num_blocks, 2, block_size, num_kv_heads, 2 * head_size),
        "separate": (2, num_blocks, block_size, num_kv_heads, head_size),
    }[layout]
    base = torch.empty(shape, dtype=dtype, device=DEVICE)
    poison(base)
    return base


def poison(base: torch.Tensor) -> None:
    if base.dtype == FP8_E4M3:
        base.view(torch.uint8).fill_(FP8_NAN_BYTE)
    else:
        base.fill_(float("nan"))


def make_inputs(
    gen: torch.Generator, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_size: int,
    dtype, layout: str, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(query, key, value) with vLLM's shapes [T, H, D] in one of the input layouts, on DEVICE."""
    q_size, kv_size = num_q_heads * head_size, num_kv_heads * head_size
    if layout == "qkv":  # views of a fused QKV projection output: row stride (Hq + 2 Hkv) D
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen) * scale
        q, k, v = qkv.to(DEVICE, dtype).split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(num_tokens, num_q_heads, head_size),
            k.view(num_tokens, num_kv_heads, head_size),
            v.view(num_tokens, num_kv_heads, head_size),
        )
    if layout == "padded_heads":  # head stride D + 16, token stride larger still

        def one(h):
            t = torch.randn(num_tokens, h + 1, head_size + 16, generator=gen) * scale
            return t.to(DEVICE, dtype)[:, :h, :head_size]

        return one(num_q_heads), one(num_kv_heads), one(num_kv_heads)
    if layout == "contiguous":

        def one(h):
            return (torch.randn(num_tokens, h, head_size, generator=gen) * scale).to(DEVICE, dtype)

        return one(num_q_heads), one(num_kv_heads), one(num_kv_heads)
    raise AssertionError(layout)


def make_slots(
    gen: torch.Generator, num_rows: int, total_slots: int, block_size: int, *,
    pad_every: int = 0, dtype=torch.int64,
) -> torch.Tensor:  # fmt: skip
    """num_rows distinct slots in random blocks (including the first and last slot of a block
    when there is room), every `pad_every`-th one replaced by -1 (padding); on DEVICE."""
    slots = torch.randperm(total_slots, generator=gen)[:num_rows]
    if num_rows >= 4:
        block = int(slots[0]) // block_size
        first, last = block * block_size, block * block_size + block_size - 1
        slots = slots[(slots != first) & (slots != last)][: num_rows - 2]
        slots = torch.cat([torch.tensor([first, last]), slots])[
            torch.randperm(num_rows, generator=gen)
        ]
    if pad_every:
        slots[2::pad_every] = -1
    return slots.to(DEVICE, dtype)


def scale_tensor(value: float, zero_dim: bool = False) -> torch.Tensor:
    return tensor(value, dtype=torch.float32) if zero_dim else tensor([value])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Whole-tensor bit comparison (NaN poison included), listing the first mismatches."""
    a = actual.view(torch.uint8) if actual.dtype == FP8_E4M3 else actual
    e = expected.view(torch.uint8) if expected.dtype == FP8_E4M3 else expected
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    bad = a.view(width) != e.view(width)
    if bad.any():
        idx = bad.nonzero()[:8]
        lines = [
            f"  at {tuple(i.tolist())}: got {actual.float()[tuple(i)].item():.6g}, "
            f"want {expected.float()[tuple(i)].item():.6g}"
            for i in idx
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ bitwise:\n"
            + "\n".join(lines)
        )


def written_elements(base: torch.Tensor) -> int:
    """Elements no longer holding the poison."""
    if base.dtype == FP8_E4M3:
        return int((base.view(torch.uint8) != FP8_NAN_BYTE).sum())
    return int((~torch.isnan(base)).sum())


def run_write_case(
    key, value, base, layout, head_size, slots, k_scale=None, v_scale=None
) -> torch.Tensor:
    """Kernel and reference on copies of the poisoned `base`; compare the whole cache."""
    expected = base.clone()
    kv_cache_update_reference(
        key, value, *cache_views(expected, layout, head_size), slots, k_scale, v_scale
    )
    kv_cache_update(key, value, *cache_views(base, layout, head_size), slots, k_scale, v_scale)
    assert_bitwise_equal(base, expected, f"cache ({layout})")
    num_valid = int((slots >= 0).sum())
    assert written_elements(base) == 2 * num_valid * key.shape[1] * head_size
    return base


# ----------------------------------------------------------------------------------------------
# Plain write
# ----------------------------------------------------------------------------------------------


# 20 cases: every (head size, dtype) pair once, block size, Hkv, layouts, slot dtype and the
# number of rows cycling underneath, so each of those values meets several head sizes.
WRITE_CASES = [
    dict(
        head_size=SUPPORTED_HEAD_SIZES[j % 5],
        dtype=(*DTYPES, FP8_E4M3)[j // 5],
        block_size=SUPPORTED_BLOCK_SIZES[j % 3],
        num_kv_heads=(1, 3, 8)[(j // 3) % 3],
        cache_layout=CACHE_LAYOUTS[(j + j // 5) % 5],
        input_layout=INPUT_LAYOUTS[j % 3],
        slot_dtype=(torch.int64, torch.int32)[j % 2],
        num_tokens=(1, 7, 23, 40)[j % 4],
        seed=j,
    )
    for j in range(20)
]


@pytest.mark.parametrize(
    "case", WRITE_CASES, ids=lambda c: "-".join(str(v).removeprefix("torch.") for v in c.values())
)
def test_write_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    fp8 = case["dtype"] == FP8_E4M3
    in_dtype = (
        (torch.bfloat16, torch.float16, torch.float32)[case["seed"] % 3] if fp8 else case["dtype"]
    )
    T, H, D, bs = case["num_tokens"], case["num_kv_heads"], case["head_size"], case["block_size"]
    _, key, value = make_inputs(gen, T, 1, H, D, in_dtype, case["input_layout"], scale=3.0)
    num_blocks = T // bs + 3
    base = make_cache(num_blocks, bs, H, D, case["dtype"], case["cache_layout"])
    # A slot mapping shorter than key when T > 1 (vLLM V1 pads key, not slot_mapping).
    num_rows = T - (T > 1) * (case["seed"] % 3)
    slots = make_slots(gen, num_rows, num_blocks * bs, bs, pad_every=5, dtype=case["slot_dtype"])
    scales = (scale_tensor(0.02, zero_dim=case["seed"] % 2 == 0), scale_tensor(0.5)) if fp8 else ()
    run_write_case(key, value, base, case["cache_layout"], D, slots, *scales)


def test_first_and_last_slot_of_every_block():
    gen = torch.Generator().manual_seed(100)
    num_blocks, bs, H, D = 3, 16, 2, 64
    slots = tensor([b * bs + o for b in range(num_blocks) for o in (0, bs - 1)])
    _, key, value = make_inputs(gen, len(slots), 1, H, D, torch.bfloat16, "qkv")
    base = make_cache(num_blocks, bs, H, D, torch.bfloat16, "nhd")
    run_write_case(key, value, base, "nhd", D, slots)
    key_cache, _ = cache_views(base, "nhd", D)
    assert torch.equal(key_cache[num_blocks - 1, bs - 1], key[-1])  # the cache's very last slot


def test_one_token():
    gen = torch.Generator().manual_seed(101)
    _, key, value = make_inputs(gen, 1, 1, 8, 128, torch.bfloat16, "qkv")
    base = make_cache(4, 16, 8, 128, torch.bfloat16, "nhd")
    run_write_case(key, value, base, "nhd", 128, tensor([37], dtype=torch.int32))
    key_cache, value_cache = cache_views(base, "nhd", 128)
    assert torch.equal(key_cache[2, 5], key[0]) and torch.equal(value_cache[2, 5], value[0])


@pytest.mark.parametrize("num_tokens", [0, 5])
def test_zero_rows_writes_nothing(num_tokens):
    gen = torch.Generator().manual_seed(102)
    _, key, value = make_inputs(gen, num_tokens, 1, 2, 64, torch.float16, "qkv")
    base = make_cache(2, 16, 2, 64, torch.float16, "nhd")
    kv_cache_update(
        key, value, *cache_views(base, "nhd", 64), torch.empty(0, dtype=torch.int64, device=DEVICE)
    )
    assert written_elements(base) == 0


def test_all_padding_writes_nothing():
    gen = torch.Generator().manual_seed(103)
    _, key, value = make_inputs(gen, 9, 1, 3, 96, torch.bfloat16, "qkv")
    base = make_cache(2, 16, 3, 96, torch.bfloat16, "hnd")
    slots = torch.full((9,), -1, dtype=torch.int64, device=DEVICE)
    slots[4] = -7  # any negative value is padding
    kv_cache_update(key, value, *cache_views(base, "hnd", 96), slots)
    assert written_elements(base) == 0


def test_rows_past_slot_mapping_are_ignored():
    gen = torch.Generator().manual_seed(104)
    _, key, value = make_inputs(gen, 12, 1, 2, 64, torch.float32, "qkv")
    base = make_cache(2, 16, 2, 64, torch.float32, "nhd")
    slots = arange(4)  # rows 4..11 of key have no slot
    run_write_case(key, value, base, "nhd", 64, slots)
    assert written_elements(base) == 2 * 4 * 2 * 64


@pytest.mark.parametrize("rope", [False, True])
def test_key_and_value_with_different_strides(rope):
    """K and V (inputs and caches) are addressed with their own strides."""
    gen = torch.Generator().manual_seed(106)
    T, Hq, H, D, bs, dtype = 11, 4, 3, 64, 16, torch.float16
    query, key, _ = make_inputs(gen, T, Hq, H, D, dtype, "qkv")
    value = torch.randn(T, H, D, generator=gen).to(DEVICE, dtype)  # contiguous, unlike key
    k_base = make_cache(2, bs, H, D, dtype, "nhd")
    v_base = make_cache(2, bs, H, D, dtype, "hnd")
    key_cache = cache_views(k_base, "nhd", D)[0]
    value_cache = cache_views(v_base, "hnd", D)[1]
    slots = make_slots(gen, T, 2 * bs, bs, pad_every=4)
    if rope:
        cs = torch.randn(32, D, generator=gen).to(DEVICE)
        positions = torch.randint(0, 32, (T,), generator=gen).to(DEVICE)
        rope_kv_cache_update(positions, query, key, value, cs, False, key_cache, value_cache, slots)
    else:
        kv_cache_update(key, value, key_cache, value_cache, slots)
    k_want, v_want = k_base.clone(), v_base.clone()
    poison(k_want)
    poison(v_want)
    kv_cache_update_reference(
        key, value, cache_views(k_want, "nhd", D)[0], cache_views(v_want, "hnd", D)[1], slots
    )
    assert_bitwise_equal(k_base, k_want, "key cache")
    assert_bitwise_equal(v_base, v_want, "value cache")


@pytest.mark.parametrize(("rows_per_program", "num_kv_heads"), [(2, 3), (4, 8), (8, 1), (16, 40)])
def test_several_rows_per_program(rows_per_program, num_kv_heads):
    """The large-N launch shapes (several tokens per program, several tiles per token when
    Hkv * D exceeds the tile), forced on a small N that leaves a partial last program."""
    gen = torch.Generator().manual_seed(105 + rows_per_program)
    T, D, bs = 37, (80, 128, 64, 256)[rows_per_program.bit_length() - 2], 16
    _, key, value = make_inputs(gen, T, 1, num_kv_heads, D, torch.bfloat16, "qkv")
    num_blocks = T // bs + 2
    base = make_cache(num_blocks, bs, num_kv_heads, D, torch.bfloat16, "nhd")
    slots = make_slots(gen, T, num_blocks * bs, bs, pad_every=6)
    expected = base.clone()
    kv_cache_update_reference(key, value, *cache_views(expected, "nhd", D), slots)
    kvc.launch._launch_write(
        kvc.KVWrite(key, value, *cache_views(base, "nhd", D), slots), False,
        rows_per_program=rows_per_program,
    )  # fmt: skip
    assert_bitwise_equal(base, expected, "cache")


def test_launch_rule():
    """Tokens per program never shrink as N grows; a program's tile stays within the bound."""
    previous = 0
    for n in (1, 16, 256, 512, 513, 4096, 32768, 1 << 20):
        rows, tile, warps = kvc.plan._write_launch_config(n, 8 * 128)
        assert (
            rows >= previous and rows * tile <= kvc.plan._WRITE_MAX_TILE_ELEMS and warps in (4, 8)
        )
        previous = rows
    assert kvc.plan._write_launch_config(1, 8 * 128) == (1, 1024, 4)  # one program for one token
    rows, tile, _ = kvc.plan._write_launch_config(1, 64 * 256)
    assert rows == 1 and tile == kvc.plan._WRITE_MAX_TILE_ELEMS  # 16384 elements -> two tiles


# The launcher picks int32 offsets and slot * slot_stride addressing whenever it can; these force
# the general paths (int64 offsets, block // and %) on small shapes, and the eviction hint.
ADDRESSING_VARIANTS = {
    "int64+block_offset": dict(offsets_64=True, flat_slots=False),
    "int64+flat": dict(offsets_64=True),
    "int32+block_offset": dict(flat_slots=False),
    "evict_first": dict(load_eviction="evict_first"),
}


@pytest.mark.parametrize("variant", list(ADDRESSING_VARIANTS))
@pytest.mark.parametrize(
    ("cache_dtype", "layout", "rows_per_program"),
    [(torch.bfloat16, "nhd", 1), (FP8_E4M3, "separate", 4), (torch.float16, "hnd", 2)],
)
def test_write_addressing_variants(variant, cache_dtype, layout, rows_per_program):
    gen = torch.Generator().manual_seed(110 + rows_per_program)
    fp8 = cache_dtype == FP8_E4M3
    T, H, D, bs = 13, 3, 64, 16
    _, key, value = make_inputs(gen, T, 1, H, D, torch.bfloat16 if fp8 else cache_dtype, "qkv")
    base = make_cache(3, bs, H, D, cache_dtype, layout)
    slots = make_slots(gen, T, 3 * bs, bs, pad_every=4)
    scales = (scale_tensor(0.02), scale_tensor(0.5)) if fp8 else (None, None)
    expected = base.clone()
    kv_cache_update_reference(key, value, *cache_views(expected, layout, D), slots, *scales)
    kvc.launch._launch_write(
        kvc.KVWrite(key, value, *cache_views(base, layout, D), slots, *scales), fp8,
        rows_per_program=rows_per_program, **ADDRESSING_VARIANTS[variant],
    )  # fmt: skip
    assert_bitwise_equal(base, expected, f"cache ({variant})")


@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_int64_block_offset_addressing(is_neox):
    gen = torch.Generator().manual_seed(120 + is_neox)
    T, Hq, H, D, bs = 6, 4, 2, 128, 16
    query, key, value = make_inputs(gen, T, Hq, H, D, torch.float16, "qkv")
    cs = torch.randn(32, 96, generator=gen).to(DEVICE)  # partial rotary: 96 of 128 dims
    positions = torch.randint(0, 32, (T,), generator=gen).to(DEVICE)
    base = make_cache(2, bs, H, D, FP8_E4M3, "hnd")
    slots = make_slots(gen, T, 2 * bs, bs, pad_every=3)
    scales = (scale_tensor(0.05), scale_tensor(0.08))
    want_q = rotary_reference(positions, query, cs, is_neox)
    want_k = rotary_reference(positions, key, cs, is_neox)
    kvc.launch._launch_rope(
        kvc.Rotary(positions, query, cs, is_neox),
        kvc.KVWrite(key, value, *cache_views(base, "hnd", D), slots, *scales),
        True, offsets_64=True, flat_slots=False,
    )  # fmt: skip
    assert_close(query, want_q, atol=2e-3, rtol=2e-3, what="query")
    assert_close(key, want_k, atol=2e-3, rtol=2e-3, what="key")
    expected = make_cache(2, bs, H, D, FP8_E4M3, "hnd")
    kv_cache_update_reference(key, value, *cache_views(expected, "hnd", D), slots, *scales)
    assert_bitwise_equal(base, expected, "cache")


@pytest.mark.parametrize("rope", [False, True])
def test_int64_padding_with_zero_low_bits(rope):
    """Padding is tested on the slot as loaded: -2^32 (low 32 bits 0) and -2^32 + 5 must not
    become slots 0 and 5 when offsets are computed in int32."""
    gen = torch.Generator().manual_seed(130 + rope)
    T, Hq, H, D, bs = 6, 2, 2, 64, 16
    query, key, value = make_inputs(gen, T, Hq, H, D, torch.float32, "qkv")
    base = make_cache(2, bs, H, D, torch.float32, "nhd")
    slots = tensor([3, -(1 << 32), 17, -(1 << 32) + 5, -1, 30])
    if rope:
        cs = torch.randn(8, D, generator=gen).to(DEVICE)
        positions = arange(T)
        rope_kv_cache_update(
            positions, query, key, value, cs, True, *cache_views(base, "nhd", D), slots
        )
    else:
        kv_cache_update(key, value, *cache_views(base, "nhd", D), slots)
    expected = make_cache(2, bs, H, D, torch.float32, "nhd")
    kv_cache_update_reference(key, value, *cache_views(expected, "nhd", D), slots)
    assert_bitwise_equal(base, expected, "cache")
    assert written_elements(base) == 2 * 3 * H * D


def test_int64_offsets_chosen_when_needed(monkeypatch):
    """Offsets past int32 (a 4.3 GB cache: meta tensors, nothing allocated) switch to int64; the
    bound covers masked rows past the end and padded head/dim lanes."""
    big = torch.empty_strided((65600, 16, 8, 128), (32768, 2048, 256, 1), device="meta")
    small = torch.empty_strided((65000, 16, 8, 128), (32768, 2048, 256, 1), device="meta")
    assert kvc.plan._needs_int64(kvc.plan._offset_bound(big))
    assert not kvc.plan._needs_int64(kvc.plan._offset_bound(small))
    key = torch.empty_strided((1000, 8, 128), (6144, 128, 1), device="meta")
    assert kvc.plan._offset_bound(key) == 999 * 6144 + 15 * 128 + 255
    assert kvc.plan._offset_bound(key, 1024) == 1023 * 6144 + 15 * 128 + 255
    # the launcher's automatic int64 path, on a small cache with the limit lowered
    monkeypatch.setattr(kvc.plan, "_INT32_MAX", 1000)
    gen = torch.Generator().manual_seed(140)
    _, key, value = make_inputs(gen, 9, 1, 2, 64, torch.bfloat16, "qkv")
    base = make_cache(2, 16, 2, 64, torch.bfloat16, "layers")
    run_write_case(key, value, base, "layers", 64, make_slots(gen, 9, 32, 16, pad_every=4))


@pytest.mark.parametrize(
    ("layout", "flat"),
    [("nhd", True), ("separate", True), ("hnd", False), ("heads_outer", True), ("layers", False)],
)
def test_flat_slot_addressing_detection(layout, flat):
    base = torch.empty(
        {
            "nhd": (4, 16, 2, 128),
            "hnd": (4, 2, 16, 128),
            "heads_outer": (2, 4, 16, 128),
            "layers": (4, 2, 16, 2, 128),
            "separate": (2, 4, 16, 2, 64),
        }[layout],
        device="meta",
    )
    assert kvc.plan._flat_slots(*cache_views(base, layout, 64)) is flat


# ----------------------------------------------------------------------------------------------
# fp8
# ----------------------------------------------------------------------------------------------

# e4m3: 3 mantissa bits, so rounding to nearest is within 2^-4 of |y|; below 2^-6 the grid is
# the subnormal spacing 2^-9, half of which is the absolute bound.
E4M3_REL_BOUND = 2.0**-4
E4M3_ABS_BOUND = 2.0**-10


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_round_trip_within_e4m3_bound(dtype):
    gen = torch.Generator().manual_seed(200)
    T, H, D, bs = 16, 2, 128, 16
    # magnitudes from 1e-5 to 1e3 of the scale: subnormals, normals and saturation
    mag = torch.logspace(-5, 3, T * H * D)[torch.randperm(T * H * D, generator=gen)]
    sign = torch.randint(0, 2, (T * H * D,), generator=gen) * 2 - 1
    k_scale, v_scale = 0.03, 1.7
    key = (mag * sign * k_scale).to(DEVICE, dtype).view(T, H, D)
    value = (mag.flip(0) * v_scale).to(DEVICE, dtype).view(T, H, D)
    base = make_cache(2, bs, H, D, FP8_E4M3, "nhd")
    slots = torch.randperm(2 * bs, generator=gen)[:T].to(DEVICE)
    run_write_case(key, value, base, "nhd", D, slots, scale_tensor(k_scale), scale_tensor(v_scale))
    key_cache, value_cache = cache_views(base, "nhd", D)
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        # index through a byte view: not every torch build indexes float8 tensors
        stored = cache.view(torch.uint8)[slots // bs, slots % bs].view(FP8_E4M3).float()
        y = x.float() / scale
        inside = y.abs() <= FP8_E4M3_MAX
        err = (stored - y).abs()
        bound = E4M3_REL_BOUND * y.abs() + E4M3_ABS_BOUND
        assert bool((err[inside] <= bound[inside]).all()), (
            f"max excess {(err - bound)[inside].max()}"
        )
        assert torch.equal(stored[~inside], y[~inside].sign() * FP8_E4M3_MAX)  # saturation
        assert int((~inside).sum()) > 0 and int((y.abs() < 2.0**-6).sum()) > 0


def test_fp8_saturation_bytes():
    key = tensor([1e4, -1e4, 448.0, -448.0, 460.0, 0.0, -0.0, 1e-9]).repeat(8).view(1, 1, 64)
    key = key.to(torch.bfloat16)
    value = -key
    base = make_cache(1, 16, 1, 64, FP8_E4M3, "separate")
    run_write_case(
        key, value, base, "separate", 64, tensor([3]), scale_tensor(1.0), scale_tensor(1.0)
    )
    stored = cache_views(base, "separate", 64)[0][0, 3, 0, :8].view(torch.uint8).tolist()
    # 448 = 0x7E, -448 = 0xFE (0x7F/0xFF are NaN), -0.0 keeps its sign bit, 1e-9 flushes to 0
    assert stored == [0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x00, 0x80, 0x00]


def test_fp8_reference_matches_torch_cast():
    x = tensor([0.1, -3.0, 500.0, -1e6])
    got = quantize_e4m3_reference(x, tensor([0.5])).float()
    assert got.tolist() == [0.203125, -6.0, 448.0, -448.0]


# ----------------------------------------------------------------------------------------------
# Fused RoPE + write
# ----------------------------------------------------------------------------------------------

ROPE_CASES = [
    # (dtype, head_size, rot_dim, is_neox, cos_sin dtype, Hq, Hkv, cache dtype, layout, T, rows)
    (torch.bfloat16, 128, 128, True, torch.bfloat16, 8, 2, None, "qkv", 9, 9),
    (torch.bfloat16, 128, 128, False, torch.float32, 6, 3, None, "padded_heads", 7, 5),
    (torch.float16, 128, 64, True, torch.float32, 4, 1, None, "qkv", 6, 6),  # partial rotary
    (torch.float16, 80, 80, False, torch.float16, 5, 1, None, "contiguous", 5, 3),
    (torch.float32, 96, 32, False, torch.bfloat16, 3, 3, None, "qkv", 4, 4),  # partial gpt-j
    (torch.float32, 64, 64, True, torch.float32, 2, 2, None, "padded_heads", 1, 1),
    (torch.bfloat16, 256, 96, True, torch.bfloat16, 2, 1, FP8_E4M3, "qkv", 5, 4),  # partial + fp8
    (torch.float16, 80, 80, False, torch.float32, 4, 2, FP8_E4M3, "qkv", 6, 6),
]


@pytest.mark.parametrize(
    "case", ROPE_CASES, ids=lambda c: "-".join(str(v).removeprefix("torch.") for v in c)
)
def test_rope_matches_reference(case):
    dtype, D, rot_dim, is_neox, cs_dtype, Hq, H, cache_dtype, layout, T, num_rows = case
    gen = torch.Generator().manual_seed(ROPE_CASES.index(case))
    atol, rtol = next((a, r) for dt, a, r in ROTARY_TOLERANCES if dt == dtype)
    query, key, value = make_inputs(gen, T, Hq, H, D, dtype, layout)
    max_pos, bs = 64, 16
    angles = torch.rand(max_pos, rot_dim // 2, generator=gen) * 6.3
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE, cs_dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    cache_dtype = cache_dtype or dtype
    base = make_cache(T // bs + 2, bs, H, D, cache_dtype, "nhd")
    slots = make_slots(gen, num_rows, (T // bs + 2) * bs, bs, pad_every=4)
    scales = (scale_tensor(0.05), scale_tensor(0.08)) if cache_dtype == FP8_E4M3 else ()
    query0, key0, value0 = query.clone(), key.clone(), value.clone()
    ref_q, ref_k, ref_v = query.clone(), key.clone(), value.clone()
    ref_cache = make_cache(T // bs + 2, bs, H, D, cache_dtype, "nhd")
    rope_kv_cache_update_reference(
        positions, ref_q, ref_k, ref_v, cos_sin_cache, is_neox, *cache_views(ref_cache, "nhd", D),
        slots, *scales,
    )  # fmt: skip

    rope_kv_cache_update(
        positions, query, key, value, cos_sin_cache, is_neox, *cache_views(base, "nhd", D), slots,
        *scales,
    )  # fmt: skip

    # q and k: every row rotated, within rounding of the fp32 reference; the pass-through
    # dims of partial rotary untouched (bitwise); value untouched.
    assert_close(query, ref_q, atol=atol, rtol=rtol, what="query")
    assert_close(key, ref_k, atol=atol, rtol=rtol, what="key")
    assert torch.equal(query[..., rot_dim:], query0[..., rot_dim:])
    assert torch.equal(key[..., rot_dim:], key0[..., rot_dim:])
    assert torch.equal(value, value0)
    # cache: exactly what the plain write makes of the key as written back ...
    expected = make_cache(T // bs + 2, bs, H, D, cache_dtype, "nhd")
    kv_cache_update_reference(key, value, *cache_views(expected, "nhd", D), slots, *scales)
    assert_bitwise_equal(base, expected, "cache")
    # ... and, where the interpreter rounds like the reference (not bf16; on the GPU, FMA
    # contraction may move any dtype by one ulp), the reference's own cache
    if INTERPRETING and dtype != torch.bfloat16:
        assert_bitwise_equal(base, ref_cache, "cache vs rope reference")
    assert written_elements(base) == 2 * int((slots >= 0).sum()) * H * D


def test_rope_reference_agrees_with_vllm_formula():
    """The reference against vLLM's forward_static formula in fp32 (rotate_neox / rotate_gptj)."""
    gen = torch.Generator().manual_seed(300)
    T, H, D, rot = 3, 2, 8, 8
    x = torch.randn(T, H, D, generator=gen)
    cs = torch.randn(10, rot, generator=gen)
    pos = torch.tensor([0, 9, 4])
    cos, sin = cs[pos].chunk(2, dim=-1)
    for is_neox in (True, False):
        if is_neox:
            cos_f, sin_f = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            rotated = torch.cat([-x[..., rot // 2 :], x[..., : rot // 2]], dim=-1)
        else:
            cos_f, sin_f = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        want = x * cos_f[:, None] + rotated * sin_f[:, None]
        assert_close(rotary_reference(pos, x, cs, is_neox), want, atol=1e-6, rtol=1e-6)


def test_rotary_only_variant_leaves_cache_alone():
    gen = torch.Generator().manual_seed(301)
    query, key, value = make_inputs(gen, 4, 4, 2, 64, torch.float32, "qkv")
    cs = torch.randn(16, 64, generator=gen).to(DEVICE)
    positions = tensor([3, 0, 15, 7])
    base = make_cache(1, 16, 2, 64, torch.float32, "nhd")
    want_q = rotary_reference(positions, query, cs, True)
    want_k = rotary_reference(positions, key, cs, True)
    kvc.launch._launch_rope(
        kvc.Rotary(positions, query, cs, True),
        kvc.KVWrite(key, value, *cache_views(base, "nhd", 64), arange(4)),
        False, write_cache=False,
    )  # fmt: skip
    assert_close(query, want_q, atol=1e-5, rtol=1e-5, what="query")
    assert_close(key, want_k, atol=1e-5, rtol=1e-5, what="key")
    assert written_elements(base) == 0


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_E4M3])
def test_unchecked_entry_point_matches_checked(cache_dtype):
    """vLLM's backend writes through `kv_cache_update_unchecked` after a layer's first (checked)
    write: the same bytes land in the same slots."""
    gen = torch.Generator().manual_seed(402)
    _, key, value = make_inputs(gen, 7, 1, 2, 64, torch.bfloat16, "qkv")
    slots = tensor([3, 40, 17, -1, 0, 63, 21])
    scales = {}
    if cache_dtype == FP8_E4M3:
        scales = dict(k_scale=tensor([0.5], dtype=torch.float32),
                      v_scale=tensor([0.25], dtype=torch.float32))  # fmt: skip
    want = make_cache(4, 16, 2, 64, cache_dtype, "nhd")
    kv_cache_update(key, value, *cache_views(want, "nhd", 64), slots, **scales)
    got = make_cache(4, 16, 2, 64, cache_dtype, "nhd")
    kvc.kv_cache_update_unchecked(key, value, *cache_views(got, "nhd", 64), slots, **scales)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def test_registered_as_custom_ops_with_fake_impls():
    assert torch.ops.fuselane.kv_cache_update.default is not None
    assert torch.ops.fuselane.rope_kv_cache_update.default is not None
    # meta tensors dispatch to the fake implementation: validates, touches nothing
    meta = dict(device="meta")
    key = torch.empty(5, 2, 64, dtype=torch.bfloat16, **meta)
    key_cache = torch.empty(3, 16, 2, 64, dtype=torch.bfloat16, **meta)
    slots = torch.empty(5, dtype=torch.int64, **meta)
    kv_cache_update(key, key, key_cache, key_cache, slots)
    with pytest.raises(ValueError, match="head_size"):
        kv_cache_update(
            key[..., :48], key[..., :48], key_cache[..., :48], key_cache[..., :48], slots
        )
    query = torch.empty(5, 4, 64, dtype=torch.bfloat16, **meta)
    cs = torch.empty(10, 64, dtype=torch.float32, **meta)
    rope_kv_cache_update(slots, query, key, key, cs, True, key_cache, key_cache, slots)


def test_torch_compile_fullgraph_on_cache_views():
    """As vLLM compiles it: one graph, the op mutating split views of one cache tensor."""
    gen = torch.Generator().manual_seed(401)
    D = 64
    _, key, value = make_inputs(gen, 5, 1, 2, D, torch.float16, "contiguous")
    slots = tensor([0, 5, 17, 33, -1])

    def step(key, value, kv, slots):
        key_cache, value_cache = kv.split(D, dim=-1)
        kv_cache_update(key * 2, value, key_cache, value_cache, slots)
        return kv.sum()

    got = make_cache(3, 16, 2, D, torch.float16, "nhd")
    torch.compile(step, backend="aot_eager", fullgraph=True)(key, value, got, slots)
    want = make_cache(3, 16, 2, D, torch.float16, "nhd")
    kv_cache_update_reference(key * 2, value, *cache_views(want, "nhd", D), slots)
    assert_bitwise_equal(got, want, "cache")


def test_opcheck():
    gen = torch.Generator().manual_seed(400)
    _, key, value = make_inputs(gen, 3, 1, 2, 64, torch.float16, "contiguous")
    key_cache = zeros(2, 16, 2, 64, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    torch.library.opcheck(
        torch.ops.fuselane.kv_cache_update.default,
        (key, value, key_cache, value_cache, tensor([0, 17, 31])),
        test_utils=("test_schema", "test_faketensor"),
    )


# ----------------------------------------------------------------------------------------------
# Bad inputs: each raises ValueError naming the argument, before any launch
# ----------------------------------------------------------------------------------------------


def _good_write_args(cache_dtype=torch.bfloat16, device=DEVICE):
    key = zeros(4, 2, 64, dtype=torch.bfloat16, device=device)
    cache = zeros(3, 16, 2, 128, dtype=cache_dtype, device=device)
    key_cache, value_cache = cache.split(64, dim=-1)
    args = dict(
        key=key, value=key.clone(), key_cache=key_cache, value_cache=value_cache,
        slot_mapping=arange(4, device=device),
    )  # fmt: skip
    if cache_dtype == FP8_E4M3:
        args.update(k_scale=ones(1, device=device), v_scale=ones(1, device=device))
    return args


META = torch.device("meta")
WRITE_ERRORS = {
    "key 2-D": (dict(key=zeros(4, 128, dtype=torch.bfloat16)), "key"),
    "key int": (dict(key=zeros(4, 2, 64, dtype=torch.int32)), "key"),
    "key last dim strided": (
        dict(key=zeros(4, 2, 128, dtype=torch.bfloat16)[..., ::2]),
        "key",
    ),
    "head size 72": (
        dict(
            key=zeros(4, 2, 72, dtype=torch.bfloat16),
            value=zeros(4, 2, 72, dtype=torch.bfloat16),
        ),
        "head_size",
    ),
    "value shape": (dict(value=zeros(4, 1, 64, dtype=torch.bfloat16)), "value"),
    "value dtype": (dict(value=zeros(4, 2, 64, dtype=torch.float16)), "value"),
    "value last dim strided": (
        dict(value=zeros(4, 2, 128, dtype=torch.bfloat16)[..., 1::2]),
        "value",
    ),
    "value device": (dict(value=zeros(4, 2, 64, dtype=torch.bfloat16, device=META)), "value"),
    "key_cache dtype": (
        dict(key_cache=zeros(3, 16, 2, 64, dtype=torch.float16)),
        "key_cache",
    ),
    "key_cache 3-D": (dict(key_cache=zeros(48, 2, 64, dtype=torch.bfloat16)), "key_cache"),
    "key_cache heads": (
        dict(key_cache=zeros(3, 16, 4, 64, dtype=torch.bfloat16)),
        "key_cache",
    ),
    "key_cache last dim strided": (
        dict(key_cache=zeros(3, 16, 2, 128, dtype=torch.bfloat16)[..., ::2]),
        "key_cache",
    ),
    "key_cache device": (
        dict(key_cache=zeros(3, 16, 2, 64, dtype=torch.bfloat16, device=META)),
        "key_cache",
    ),
    "block size 8": (
        dict(
            key_cache=zeros(3, 8, 2, 64, dtype=torch.bfloat16),
            value_cache=zeros(3, 8, 2, 64, dtype=torch.bfloat16),
        ),
        "block_size",
    ),
    "value_cache shape": (
        dict(value_cache=zeros(2, 16, 2, 64, dtype=torch.bfloat16)),
        "value_cache",
    ),
    "value_cache dtype": (
        dict(value_cache=zeros(3, 16, 2, 64, dtype=FP8_E4M3)),
        "value_cache",
    ),
    "slot_mapping float": (dict(slot_mapping=zeros(4)), "slot_mapping"),
    "slot_mapping 2-D": (dict(slot_mapping=zeros(4, 1, dtype=torch.int64)), "slot_mapping"),
    "slot_mapping longer than key": (dict(slot_mapping=arange(5)), "slot_mapping"),
    "slot_mapping strided": (dict(slot_mapping=arange(8)[::2]), "slot_mapping"),
    "slot_mapping device": (dict(slot_mapping=arange(4, device=META)), "slot_mapping"),
    "k_scale dtype": (dict(k_scale=tensor([1.0], dtype=torch.float16)), "k_scale"),
    "v_scale two elements": (dict(v_scale=ones(2)), "v_scale"),
}
FP8_ERRORS = {
    "fp8 without k_scale": (dict(k_scale=None), "k_scale"),
    "fp8 without v_scale": (dict(v_scale=None), "v_scale"),
    "fp8 k_scale device": (dict(k_scale=ones(1, device=META)), "k_scale"),
}


@pytest.mark.parametrize("name", list(WRITE_ERRORS) + list(FP8_ERRORS))
@pytest.mark.parametrize("op", ["kernel", "reference"])
def test_write_rejects_bad_input(name, op):
    override, arg = {**WRITE_ERRORS, **FP8_ERRORS}[name]
    args = _good_write_args(FP8_E4M3 if name in FP8_ERRORS else torch.bfloat16)
    args.update(override)
    fn = kv_cache_update if op == "kernel" else kv_cache_update_reference
    with pytest.raises(ValueError, match=rf"^{arg}\b") as err:
        fn(**args)
    assert "expected" in str(err.value) and "got" in str(err.value)


def test_non_tensor_argument_is_refused():
    # eager calls validate it themselves; under torch.compile the op's schema refuses it
    with pytest.raises(ValueError, match=r"^key: expected a torch.Tensor, got list"):
        kv_cache_update(**{**_good_write_args(), "key": [0.0]})
    with pytest.raises(RuntimeError, match="argument 'key'"):
        torch.ops.fuselane.kv_cache_update(**{**_good_write_args(), "key": [0.0]})
    with pytest.raises(ValueError, match=r"^key: expected a torch.Tensor, got list"):
        kv_cache_update_reference(**{**_good_write_args(), "key": [0.0]})


def _good_rope_args(device=DEVICE):
    args = _good_write_args(device=device)
    args.update(
        positions=arange(4, device=device),
        query=zeros(4, 6, 64, dtype=torch.bfloat16, device=device),
        cos_sin_cache=zeros(16, 64, dtype=torch.float32, device=device),
        is_neox=True,
    )
    return args


ROPE_ERRORS = {
    "positions length": (dict(positions=arange(3)), "positions"),
    "positions float": (dict(positions=zeros(4)), "positions"),
    "positions device": (dict(positions=arange(4, device=META)), "positions"),
    "query head size": (dict(query=zeros(4, 6, 128, dtype=torch.bfloat16)), "query"),
    "query tokens": (dict(query=zeros(5, 6, 64, dtype=torch.bfloat16)), "query"),
    "query dtype": (dict(query=zeros(4, 6, 64, dtype=torch.float32)), "query"),
    "query last dim strided": (
        dict(query=zeros(4, 6, 128, dtype=torch.bfloat16)[..., ::2]),
        "query",
    ),
    "cos_sin_cache odd rot_dim": (dict(cos_sin_cache=zeros(16, 63)), "cos_sin_cache"),
    "cos_sin_cache rot_dim > head_size": (dict(cos_sin_cache=zeros(16, 66)), "cos_sin_cache"),
    "cos_sin_cache int": (
        dict(cos_sin_cache=zeros(16, 64, dtype=torch.int32)),
        "cos_sin_cache",
    ),
    "cos_sin_cache 1-D": (dict(cos_sin_cache=zeros(64)), "cos_sin_cache"),
    "key shape (write part)": (dict(key=zeros(4, 3, 64, dtype=torch.bfloat16)), "value"),
    "slot_mapping (write part)": (dict(slot_mapping=arange(5)), "slot_mapping"),
}


@pytest.mark.parametrize("name", list(ROPE_ERRORS))
def test_rope_rejects_bad_input(name):
    override, arg = ROPE_ERRORS[name]
    args = _good_rope_args()
    args.update(override)
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        rope_kv_cache_update(**args)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    """CPU tensors without the interpreter (on a GPU machine: as it is) are refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^key: expected a CUDA tensor"):
        kv_cache_update(**_good_write_args(device=cpu))
    with pytest.raises(ValueError, match=r"^key: expected a CUDA tensor"):
        rope_kv_cache_update(**_good_rope_args(device=cpu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_E4M3])
def test_warm_up_write_launches_each_bucket_and_writes_nothing(dtype):
    """Start-up compilation: one launch per row bucket of the launch rule, all padding slots."""
    base = make_cache(4, 16, 2, 64, dtype, "nhd")
    before = base.clone()
    scale = torch.ones(1, dtype=torch.float32, device=DEVICE)
    launched = kvc.warm_up_write(
        *cache_views(base, "nhd", 64), key_dtype=torch.bfloat16, k_scale=scale, v_scale=scale
    )
    assert launched == len(kvc.plan._WRITE_ROWS_PER_PROGRAM)
    assert torch.equal(base.view(torch.uint8), before.view(torch.uint8))

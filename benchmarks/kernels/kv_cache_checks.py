"""The KV-cache script's broad GPU check (bench_kv_cache): fuselane against its torch reference
on fresh random inputs over several shapes, PASS / FAIL lines.

The writes include forced int64 / block-and-offset addressing and one cache of more than 2^31
elements (where the launcher must fall back to int64 offsets by itself); the fused RoPE + write
compares q and k within rounding of the reference rotary and the cache bit for bit. A section
whose check fails is not timed for fuselane.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels import kv_cache_workload as kvw
from fuselane.benchmarks.kernels.kv_cache_workload import (
    FP8,
    ROTARY_TOL,
    fp8_scales,
    make_cache,
    mismatches,
    poison,
    rope_cos_sin,
)
from fuselane.kernels import kv_cache as kvc

# addressing: "auto" = the launcher's own choice (int32 offsets on all these shapes, slot *
# slot_stride where the layout allows); "64" = int64 block-and-offset addressing forced;
# "big" = a cache of more than 2^31 elements (4.3 GB), where the launcher must pick int64 itself.
WRITE_CHECKS = [
    # (tokens, Hkv, D, page, input dtype, cache dtype, slot dtype, cache layout, addressing)
    (1, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int64, "nhd", "auto"),
    (257, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int32, "nhd", "auto"),
    (4099, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int64, "nhd", "auto"),
    (20000, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int64, "nhd", "auto"),
    (20000, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int64, "nhd", "64"),
    (333, 3, 80, 32, torch.float16, torch.float16, torch.int64, "hnd", "auto"),
    (77, 1, 256, 64, torch.float32, torch.float32, torch.int32, "nhd", "auto"),
    (37, 64, 256, 16, torch.bfloat16, torch.bfloat16, torch.int64, "hnd", "auto"),
    (37, 64, 256, 16, torch.bfloat16, torch.bfloat16, torch.int64, "hnd", "64"),
    (1000, 8, 96, 16, torch.bfloat16, FP8, torch.int64, "nhd", "auto"),
    (9000, 4, 64, 32, torch.float16, FP8, torch.int32, "hnd", "auto"),
    (513, 8, 128, 16, torch.float32, FP8, torch.int64, "nhd", "auto"),
    (513, 8, 128, 16, torch.bfloat16, FP8, torch.int64, "nhd", "64"),
    (3000, 8, 128, 16, torch.bfloat16, torch.bfloat16, torch.int64, "nhd", "big"),
]
BIG_CACHE_PAGES = (1 << 31) // (16 * 8 * 2 * 128) + 64  # > 2^31 elements in [pages, 16, 8, 256]
ROPE_CHECKS = [
    # (tokens, Hq, Hkv, D, rot_dim, neox, dtype, cos_sin dtype, cache dtype, addressing)
    (1, 32, 8, 128, 128, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, "auto"),
    (1000, 32, 8, 128, 128, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, "auto"),
    (1000, 32, 8, 128, 128, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, "auto"),
    (1000, 32, 8, 128, 128, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, "64"),
    (333, 12, 2, 64, 32, False, torch.float16, torch.float32, torch.float16, "auto"),
    (100, 8, 8, 256, 64, True, torch.bfloat16, torch.float32, FP8, "auto"),
    (100, 8, 8, 256, 64, False, torch.bfloat16, torch.float32, FP8, "64"),
    (77, 5, 1, 80, 80, False, torch.float32, torch.bfloat16, torch.float32, "auto"),
]


def check_write(case: tuple, gen: torch.Generator) -> tuple[bool, str]:
    tokens, heads, head_size, page, dtype, cache_dtype, slot_dtype, layout, addr = case
    num_pages = BIG_CACHE_PAGES if addr == "big" else tokens // page + 3
    k = torch.randn(tokens, heads + 1, head_size, generator=gen).to(kvw.DEVICE, dtype)[:, 1:]
    v = torch.randn(tokens, heads, head_size, generator=gen).to(kvw.DEVICE, dtype) * 2
    shape = (num_pages, page, heads, 2 * head_size)
    if layout == "hnd":
        shape = (num_pages, heads, page, 2 * head_size)
    base = torch.empty(shape, dtype=cache_dtype, device=kvw.DEVICE)
    poison(base)
    want = base.clone()

    def views(t: torch.Tensor) -> list[torch.Tensor]:
        return (t.transpose(1, 2) if layout == "hnd" else t).split(head_size, dim=-1)

    slots = torch.randperm(num_pages * page, generator=gen)[:tokens]
    slots[3::7] = -1
    if addr == "big":
        slots[0] = num_pages * page - 1  # the very last slot: element offset > 2^31
    if slot_dtype == torch.int64 and tokens > 5:
        slots[5] = -(1 << 32)  # padding whose low 32 bits are 0: must not become slot 0
    slots = slots.to(kvw.DEVICE, slot_dtype)
    scales = ()
    if cache_dtype == FP8:
        scales = fp8_scales()
    kvc.kv_cache_update_reference(k, v, *views(want), slots, *scales)
    kc, vc = views(base)
    offsets_64 = kvc.plan._needs_int64(*(kvc.plan._offset_bound(t) for t in (k, v, kc, vc)))
    flat = kvc.plan._flat_slots(kc, vc)
    if addr == "64":
        kv_scales = scales or (None, None)
        write = kvc.KVWrite(k, v, kc, vc, slots, *kv_scales)
        fp8 = kvc.checks._check_write_args(write)
        kvc.launch._launch_write(write, fp8, offsets_64=True, flat_slots=False)
        offsets_64, flat = True, False
    else:
        kvc.kv_cache_update(k, v, kc, vc, slots, *scales)
    torch.cuda.synchronize()
    bad = mismatches(base, want)
    ok = bad == 0 and (addr != "big" or offsets_64)
    del base, want
    return ok, (
        f"{bad} of {num_pages * page * heads * 2 * head_size} cache elements differ bitwise "
        f"({'int64' if offsets_64 else 'int32'} offsets, "
        f"{'slot * stride' if flat else 'block/offset'} addressing)"
    )


def check_rope(case: tuple, gen: torch.Generator) -> tuple[bool, str]:
    tokens, hq, heads, head_size, rot_dim, neox, dtype, cs_dtype, cache_dtype, addr = case
    page = 16
    num_pages = tokens // page + 3
    qkv = torch.randn(tokens, (hq + 2 * heads) * head_size, generator=gen).to(kvw.DEVICE, dtype)
    q, k, v = qkv.split([hq * head_size, heads * head_size, heads * head_size], dim=-1)
    q, k, v = (
        q.view(tokens, hq, head_size),
        k.view(tokens, heads, head_size),
        v.view(tokens, heads, head_size),
    )
    cs = rope_cos_sin(4096, rot_dim, cs_dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(kvw.DEVICE)
    slots = torch.randperm(num_pages * page, generator=gen)[:tokens]
    slots[2::5] = -1
    slots = slots.to(kvw.DEVICE)
    scales = ()
    if cache_dtype == FP8:
        scales = fp8_scales()
    base, kc, vc = make_cache(num_pages, cache_dtype, page, heads, head_size)
    want_q = kvc.rotary_reference(positions, q, cs, neox)
    want_k = kvc.rotary_reference(positions, k, cs, neox)
    if addr == "64":
        kv_scales = scales or (None, None)
        write = kvc.KVWrite(k, v, kc, vc, slots, *kv_scales)
        fp8 = kvc.checks._check_write_args(write)
        rotary = kvc.Rotary(positions, q, cs, neox)
        kvc.launch._launch_rope(rotary, write, fp8, offsets_64=True, flat_slots=False)
    else:
        kvc.rope_kv_cache_update(positions, q, k, v, cs, neox, kc, vc, slots, *scales)
    torch.cuda.synchronize()
    atol, rtol = ROTARY_TOL[dtype]
    err = max(
        float(((q.float() - want_q.float()).abs() - rtol * want_q.float().abs()).max()),
        float(((k.float() - want_k.float()).abs() - rtol * want_k.float().abs()).max()),
    )
    nan = bool(torch.isnan(q).any() or torch.isnan(k).any())
    want_cache, kc2, vc2 = make_cache(num_pages, cache_dtype, page, heads, head_size)
    kvc.kv_cache_update_reference(k, v, kc2, vc2, slots, *scales)
    bad = mismatches(base, want_cache)
    ok = not nan and err <= atol and bad == 0
    return ok, f"q/k excess over rtol {err:.3g} (atol {atol}), {bad} cache elements differ bitwise"


def run_checks(note: Callable[[str], None]) -> dict[str, bool]:
    """WRITE_CHECKS and ROPE_CHECKS: a PASS / FAIL line each (failures noted); whether every
    check of the bf16 writes (`write`), the fp8 writes (`fp8`) and RoPE + write (`rope`) passed."""
    gen = torch.Generator().manual_seed(1234)
    ok = {"write": True, "fp8": True, "rope": True}
    for kind, cases, check in (
        ("write", WRITE_CHECKS, check_write),
        ("rope", ROPE_CHECKS, check_rope),
    ):
        for case in cases:
            name = f"{kind} " + " ".join(str(x).removeprefix("torch.") for x in case)
            if not family_script.check_line(note, name, functools.partial(check, case, gen)):
                ok["fp8" if kind == "write" and case[5] == FP8 else kind] = False
    return ok

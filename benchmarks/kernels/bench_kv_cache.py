"""GPU benchmark of the KV-cache update family (kernels/kv_cache.py) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_kv_cache.py --out $OUT

Order of work, all in one process on one device (~2 minutes on an H200):
  1. ceilings: copy bandwidth (1 GiB device-to-device, timed eagerly) and an empty Triton
     kernel's replay time;
  2. check: fuselane against its torch reference on fresh random inputs over several shapes
     (PASS/FAIL lines), including forced int64 / block-and-offset addressing and one cache of
     more than 2^31 elements (the launcher must fall back to int64 offsets by itself); a
     section whose check fails is not timed for fuselane;
  3. kv_write (bf16) and kv_write_fp8 at 1..32768 tokens, rope_kv_write (neox at 1..8192
     tokens, gpt-j at 1 and 8192): each case first verifies fuselane's cache against the
     reference on the timed inputs (and each peer's cache against fuselane's, reported in the
     notes), then times fuselane and every peer by CUDA-graph replay (`harness.time_graph`),
     ROUNDS times in interleaved order, reporting the median round (and every round's time);
  4. floor: what any implementation of the write must spend at the same sizes, next to
     fuselane: an empty kernel, and a Triton copy of the same key/value bytes to a contiguous
     buffer with no slot lookup (same launch shape as fuselane's rule);
  5. sweeps: kv_write_sweep times the write at other (tokens per program, warps) settings than
     the launch rule picks, and the rule's setting with int64 block-and-offset addressing
     (`[addr64]`) and with evict-first key/value loads (`[evict_first]`); kv_write_fp8_sweep
     times the fp8 write with the interpreter's exact rounding emulation (`[emulated]`) and
     with int64 addressing, to fill the tables in kernels/kv_cache.py;
  6. GOAL lines (the family's targets), then the table; JSON to --out and benchmarks/results/.

Workload (Llama-3-8B attention shapes, as the peers' H200 anchors): Hkv=8, D=128, page 16, bf16;
key/value are strided views of a fused QKV output (Hq=32); the cache is vLLM's TRITON_ATTN
layout, K and V as `split` views of one [num_pages, page, Hkv, 2*D] tensor, the same tensors
for every implementation. Up to 256 tokens are a decode batch (one token per request, random
context lengths); more are prefill chunks of 2048 tokens. Pages are a random permutation.
Bytes counted: K and V read plus K and V written (plus q/k rotary traffic for rope cases).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:  # an installed checkout (pip install -e .)
    from fuselane.benchmarks import harness
    from fuselane.kernels import kv_cache as kvc
except ImportError:  # a bare checkout (the GPU machine): the root folders are packages
    from benchmarks import harness
    from kernels import kv_cache as kvc

HQ, HKV, D, PAGE = 32, 8, 128, 16
TOKENS = (1, 16, 256, 4096, 32768)
ROPE_TOKENS = (1, 64, 1024, 8192)  # neox
ROPE_GPTJ_TOKENS = (1, 8192)
SWEEP_TOKENS = (1, 256, 1024, 2048, 4096, 32768)
SWEEP_ROWS = (1, 2, 4, 8, 16)
SWEEP_WARPS = (2, 4, 8)
FP8_SWEEP_TOKENS = (1, 256, 4096, 32768)
ROUNDS = 3  # each case's impls are timed this many times, interleaved; the median round counts
DECODE_MAX_TOKENS = 256  # up to this many tokens: one token per request
PREFILL_CHUNK = 2048
DECODE_MAX_CONTEXT = 512
K_SCALE, V_SCALE = 0.05, 0.04  # fp8 scales: randn / 0.05 stays well inside +-448
# Goals of the KV-cache family
GOAL_PCT_COPY = 90.0
GOAL_GAP_US = 0.3
GOAL_GAP_MAX_TOKENS = 256
GOAL_FP8_SLOWDOWN = 1.10
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"  # a module constant so that the script's logic can be dry-run elsewhere
# GPU check tolerances for rotated q/k: fp32 math may contract to FMA on the GPU, so a value can
# round one ulp away from the reference's; the cache copy itself is compared bit for bit.
ROTARY_TOL = {
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (1e-5, 1e-5),
}


def case_name(tokens: int) -> str:
    return f"tokens={tokens} Hkv={HKV} D={D} page={PAGE}"


def rope_case_name(tokens: int, neox: bool = True) -> str:
    return f"tokens={tokens} Hq={HQ} Hkv={HKV} D={D} page={PAGE} {'neox' if neox else 'gptj'}"


# ----------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's page table, as vLLM (slot_mapping) and FlashInfer (indptr form) see it."""

    num_tokens: int
    num_pages: int
    slot_mapping: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    append_indptr: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32


def make_batch(num_tokens: int, gen: torch.Generator, page: int = PAGE) -> Batch:
    if num_tokens <= DECODE_MAX_TOKENS:
        append = [1] * num_tokens
        seq = torch.randint(1, DECODE_MAX_CONTEXT + 1, (num_tokens,), generator=gen).tolist()
    else:
        append = [PREFILL_CHUNK] * (num_tokens // PREFILL_CHUNK)
        if num_tokens % PREFILL_CHUNK:
            append.append(num_tokens % PREFILL_CHUNK)
        seq = list(append)
    pages_per_req = [math.ceil(s / page) for s in seq]
    num_pages = sum(pages_per_req)
    perm = torch.randperm(num_pages, generator=gen)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per_req).cumsum(0).tolist()])
    slots, positions = [], []
    for b, (a, s) in enumerate(zip(append, seq, strict=True)):
        pos = torch.arange(s - a, s)
        pages = perm[kv_indptr[b] : kv_indptr[b + 1]]
        slots.append(pages[pos // page] * page + pos % page)
        positions.append(pos)
    last = [s - (p - 1) * page for s, p in zip(seq, pages_per_req, strict=True)]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return Batch(
        num_tokens=num_tokens,
        num_pages=num_pages,
        slot_mapping=torch.cat(slots).to(DEVICE),
        positions=torch.cat(positions).to(DEVICE),
        kv_indptr=kv_indptr.to(**i32),
        kv_indices=perm.to(**i32),
        kv_last_page_len=torch.tensor(last, **i32),
        append_indptr=torch.tensor([0, *torch.tensor(append).cumsum(0).tolist()], **i32),
        seq_lens=torch.tensor(seq, **i32),
    )


def make_qkv(
    num_tokens: int,
    gen: torch.Generator,
    dtype=torch.bfloat16,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
):
    """(q, k, v) as strided [T, H, D] views of one fused QKV output."""
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)


def make_cache(num_pages: int, dtype, page: int = PAGE, heads: int = HKV, head_size: int = D):
    """(base, key_cache, value_cache): vLLM TRITON_ATTN views of one poisoned tensor."""
    base = torch.empty(num_pages, page, heads, 2 * head_size, dtype=dtype, device=DEVICE)
    poison(base)
    key_cache, value_cache = base.split(head_size, dim=-1)
    return base, key_cache, value_cache


def poison(t: torch.Tensor) -> None:
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        t.fill_(float("nan"))


def bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(torch.uint8).view(width) if t.dtype == FP8 else t.view(width)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (the NaN poison included)."""
    return int((bits(a) != bits(b)).sum())


def rope_cos_sin(max_pos: int, rot_dim: int, dtype) -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE, dtype)


# ----------------------------------------------------------------------------------------------
# Peers (each optional: a failure to import or to run is recorded and the run goes on)
# ----------------------------------------------------------------------------------------------


class Peers:
    def __init__(self, report: harness.Report) -> None:
        self.report = report
        self.vllm_write: Callable | None = None
        self.flashinfer = None
        try:
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash,
            )

            self.vllm_write = triton_reshape_and_cache_flash
        except Exception as e:  # noqa: BLE001 - any import failure disables this peer
            self.note(f"vllm triton_reshape_and_cache_flash unavailable: {e!r}")
        try:
            import flashinfer

            self.flashinfer = flashinfer
        except Exception as e:  # noqa: BLE001
            self.note(f"flashinfer unavailable: {e!r}")

    def note(self, text: str) -> None:
        print(f"NOTE {text}", flush=True)
        self.report.notes.append(text)


# ----------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------


def write_bytes(tokens: int, in_bytes: int, cache_bytes: int) -> int:
    """K and V: read once, written once; plus the slot mapping."""
    return tokens * HKV * D * 2 * (in_bytes + cache_bytes) + tokens * 8


def rope_bytes(tokens: int, cache_bytes: int) -> int:
    """q read+write, k read+write+cache, v read+cache, one cos/sin row, positions and slots."""
    el = 2  # bf16
    q = tokens * HQ * D * el * 2
    k = tokens * HKV * D * (el * 2 + cache_bytes)
    v = tokens * HKV * D * (el + cache_bytes)
    return q + k + v + tokens * (D * el + 16)


class Runner:
    def __init__(self, report: harness.Report, empty_us: float) -> None:
        self.report = report
        self.empty_us = empty_us
        self.peers = Peers(report)

    def time(
        self,
        section: str,
        case: str,
        impls: list[tuple[str, Callable[[], object]]],
        nbytes: int,
        rounds: int = ROUNDS,
    ) -> None:
        """Time every impl `rounds` times, interleaved (impl 1, 2, ..., then again), so a drift
        of clocks or memory state hits all of them alike; one row per impl: the median round,
        with every round's time and the spread in the row's extra fields."""
        times: dict[str, list[float]] = {name: [] for name, _ in impls}
        for _ in range(rounds):
            for impl, fn in impls:
                if impl not in times:  # failed in an earlier round
                    continue
                try:
                    times[impl].append(harness.time_graph(fn))
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
                    self.peers.note(f"{section} {case} {impl}: timing failed: {e!r}")
                    torch.cuda.synchronize()
                    del times[impl]
        for impl, _ in impls:
            if impl not in times:
                continue
            ms = statistics.median(times[impl])
            us = ms * 1e3
            rounds_us = [round(t * 1e3, 3) for t in times[impl]]
            self.report.add(
                harness.Row(
                    section,
                    case,
                    impl,
                    ms,
                    nbytes=nbytes,
                    extra={
                        "gap_to_empty_us": round(us - self.empty_us, 3),
                        "rounds_us": rounds_us,
                        "spread_us": round(max(rounds_us) - min(rounds_us), 3),
                    },
                )
            )
            print(
                f"  {section:<18} {case:<42} {impl:<44} {us:9.3f} us  "
                f"(rounds {', '.join(f'{t:.3f}' for t in rounds_us)})",
                flush=True,
            )


def try_run(peers: Peers, label: str, fn: Callable[[], object]) -> bool:
    """Run fn once (JIT builds happen here); False and a note if it raises."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001
        peers.note(f"{label}: failed to run: {e!r}")
        traceback.print_exc()
        return False


# ----------------------------------------------------------------------------------------------
# 2. GPU check against the reference
# ----------------------------------------------------------------------------------------------

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


def check_write(case, gen: torch.Generator) -> tuple[bool, str]:
    tokens, heads, head_size, page, dtype, cache_dtype, slot_dtype, layout, addr = case
    num_pages = BIG_CACHE_PAGES if addr == "big" else tokens // page + 3
    k = torch.randn(tokens, heads + 1, head_size, generator=gen).to(DEVICE, dtype)[:, 1:]
    v = torch.randn(tokens, heads, head_size, generator=gen).to(DEVICE, dtype) * 2
    shape = (num_pages, page, heads, 2 * head_size)
    if layout == "hnd":
        shape = (num_pages, heads, page, 2 * head_size)
    base = torch.empty(shape, dtype=cache_dtype, device=DEVICE)
    poison(base)
    want = base.clone()

    def views(t):
        return (t.transpose(1, 2) if layout == "hnd" else t).split(head_size, dim=-1)

    slots = torch.randperm(num_pages * page, generator=gen)[:tokens]
    slots[3::7] = -1
    if addr == "big":
        slots[0] = num_pages * page - 1  # the very last slot: element offset > 2^31
    if slot_dtype == torch.int64 and tokens > 5:
        slots[5] = -(1 << 32)  # padding whose low 32 bits are 0: must not become slot 0
    slots = slots.to(DEVICE, slot_dtype)
    scales = ()
    if cache_dtype == FP8:
        scales = (torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE))
    kvc.kv_cache_update_reference(k, v, *views(want), slots, *scales)
    kc, vc = views(base)
    offsets_64 = kvc.plan._needs_int64(*(kvc.plan._offset_bound(t) for t in (k, v, kc, vc)))
    flat = kvc.plan._flat_slots(kc, vc)
    if addr == "64":
        kv_scales = scales or (None, None)
        fp8 = kvc.checks._check_write_args(k, v, kc, vc, slots, *kv_scales)
        kvc.launch._launch_write(
            k, v, kc, vc, slots, *kv_scales, fp8, offsets_64=True, flat_slots=False
        )
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


def check_rope(case, gen: torch.Generator) -> tuple[bool, str]:
    tokens, hq, heads, head_size, rot_dim, neox, dtype, cs_dtype, cache_dtype, addr = case
    page = 16
    num_pages = tokens // page + 3
    qkv = torch.randn(tokens, (hq + 2 * heads) * head_size, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_size, heads * head_size, heads * head_size], dim=-1)
    q, k, v = (
        q.view(tokens, hq, head_size),
        k.view(tokens, heads, head_size),
        v.view(tokens, heads, head_size),
    )
    cs = rope_cos_sin(4096, rot_dim, cs_dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_pages * page, generator=gen)[:tokens]
    slots[2::5] = -1
    slots = slots.to(DEVICE)
    scales = ()
    if cache_dtype == FP8:
        scales = (torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE))
    base, kc, vc = make_cache(num_pages, cache_dtype, page, heads, head_size)
    want_q = kvc.rotary_reference(positions, q, cs, neox)
    want_k = kvc.rotary_reference(positions, k, cs, neox)
    if addr == "64":
        kv_scales = scales or (None, None)
        fp8 = kvc.checks._check_write_args(k, v, kc, vc, slots, *kv_scales)
        kvc.launch._launch_rope(positions, q, k, v, cs, neox, kc, vc, slots, *kv_scales, fp8,
                         offsets_64=True, flat_slots=False)  # fmt: skip
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


def run_checks(peers: Peers) -> dict[str, bool]:
    gen = torch.Generator().manual_seed(1234)
    ok = {"write": True, "fp8": True, "rope": True}
    for case in WRITE_CHECKS:
        name = "write " + " ".join(str(x).removeprefix("torch.") for x in case)
        try:
            passed, detail = check_write(case, gen)
        except Exception as e:  # noqa: BLE001 - a crash is a failure, reported like one
            passed, detail = False, repr(e)
            traceback.print_exc()
        print(f"{'PASS' if passed else 'FAIL'} check {name}: {detail}", flush=True)
        if not passed:
            ok["fp8" if case[5] == FP8 else "write"] = False
            peers.note(f"check FAILED: {name}: {detail}")
    for case in ROPE_CHECKS:
        name = "rope " + " ".join(str(x).removeprefix("torch.") for x in case)
        try:
            passed, detail = check_rope(case, gen)
        except Exception as e:  # noqa: BLE001
            passed, detail = False, repr(e)
            traceback.print_exc()
        print(f"{'PASS' if passed else 'FAIL'} check {name}: {detail}", flush=True)
        if not passed:
            ok["rope"] = False
            peers.note(f"check FAILED: {name}: {detail}")
    return ok


# ----------------------------------------------------------------------------------------------
# 3. Timed sections
# ----------------------------------------------------------------------------------------------


def bench_write(
    run: Runner, tokens: int, fp8: bool, fuselane_ok: bool, gen: torch.Generator
) -> None:
    section = "kv_write_fp8" if fp8 else "kv_write"
    case = case_name(tokens)
    peers = run.peers
    batch = make_batch(tokens, gen)
    _, k, v = make_qkv(tokens, gen)
    cache_dtype = FP8 if fp8 else torch.bfloat16
    base, kc, vc = make_cache(batch.num_pages, cache_dtype)
    slots = batch.slot_mapping
    k_scale = torch.tensor([K_SCALE if fp8 else 1.0], device=DEVICE)
    v_scale = torch.tensor([V_SCALE if fp8 else 1.0], device=DEVICE)
    scales = (k_scale, v_scale) if fp8 else ()
    nbytes = write_bytes(tokens, 2, 1 if fp8 else 2)

    # the reference's cache for these exact inputs: fuselane must match it bit for bit
    want, kw, vw = make_cache(batch.num_pages, cache_dtype)
    kvc.kv_cache_update_reference(k, v, kw, vw, slots, *scales)

    def fuselane():
        kvc.kv_cache_update(k, v, kc, vc, slots, *scales)

    impls: list[tuple[str, Callable[[], object]]] = []
    if fuselane_ok:
        poison(base)
        fuselane()
        bad = mismatches(base, want)
        if bad:
            peers.note(f"{section} {case}: fuselane differs from the reference in {bad} elements")
            peers.note(f"{section} {case}: fuselane not timed")
        else:
            impls.append(("fuselane", fuselane))
    else:
        peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")

    # torch: index_copy_ into the (slot)-flattened cache views
    kc_flat, vc_flat = kc.flatten(0, 1), vc.flatten(0, 1)
    if fp8:
        kc_u8, vc_u8 = kc_flat.view(torch.uint8), vc_flat.view(torch.uint8)

        def torch_peer():
            kq = kvc.quantize_e4m3_reference(k, k_scale).view(torch.uint8)
            vq = kvc.quantize_e4m3_reference(v, v_scale).view(torch.uint8)
            kc_u8.index_copy_(0, slots, kq)
            vc_u8.index_copy_(0, slots, vq)

        impls.append(("torch-quant+index_copy", torch_peer))
    else:

        def torch_peer():
            kc_flat.index_copy_(0, slots, k)
            vc_flat.index_copy_(0, slots, v)

        impls.append(("torch-index_copy", torch_peer))

    if peers.vllm_write is not None:
        kv_dtype = "fp8" if fp8 else "auto"

        def vllm_peer():
            peers.vllm_write(k, v, kc, vc, slots, kv_dtype, k_scale, v_scale)

        impls.append(("vllm-triton-reshape_and_cache_flash", vllm_peer))

    if peers.flashinfer is not None and not fp8:
        fi = peers.flashinfer
        batch_indices, positions = fi.get_batch_indices_positions(
            batch.append_indptr, batch.seq_lens, tokens
        )

        def flashinfer_peer():
            fi.append_paged_kv_cache(
                k, v, batch_indices, positions, (kc, vc),
                batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "NHD",
            )  # fmt: skip

        impls.append(("flashinfer-append_paged_kv_cache", flashinfer_peer))
    elif fp8:
        peers.note(
            f"{section} {case}: flashinfer append_paged_kv_cache has no quantize-on-write "
            "(it needs fp8 inputs), not timed"
        )

    timed = []
    for impl, fn in impls:
        if impl != "fuselane":
            poison(base)
            if not try_run(peers, f"{section} {case} {impl}", fn):
                continue
            bad = mismatches(base, want)
            if bad:  # informational: the peer does not compute exactly the reference's bytes
                got, ref = base.float(), want.float()
                poison_diff = int((got.isnan() != ref.isnan()).sum())
                both = ~(got.isnan() | ref.isnan())
                max_diff = float((got - ref)[both].abs().max()) if both.any() else 0.0
                peers.note(
                    f"{section} {case} {impl}: {bad} elements differ bitwise from the "
                    f"reference ({poison_diff} poisoned/written mismatches, max abs diff "
                    f"{max_diff:.3g} elsewhere)"
                )
        timed.append((impl, fn))
    run.time(section, case, timed, nbytes)


def bench_rope(
    run: Runner, tokens: int, fuselane_ok: bool, gen: torch.Generator, neox: bool = True
) -> None:
    section, case = "rope_kv_write", rope_case_name(tokens, neox)
    peers = run.peers
    batch = make_batch(tokens, gen)
    q, k, v = make_qkv(tokens, gen)  # rotated in place, call after call (norms are kept)
    base, kc, vc = make_cache(batch.num_pages, torch.bfloat16)
    cs = rope_cos_sin(DECODE_MAX_CONTEXT + PREFILL_CHUNK, D, torch.bfloat16)
    pos, slots = batch.positions, batch.slot_mapping
    nbytes = rope_bytes(tokens, 2)

    def fused():
        kvc.rope_kv_cache_update(pos, q, k, v, cs, neox, kc, vc, slots)

    def fuselane_rotary_then_write():
        kvc.launch._launch_rope(
            pos, q, k, v, cs, neox, kc, vc, slots, None, None, False, write_cache=False
        )
        kvc.kv_cache_update(k, v, kc, vc, slots)

    def torch_rotary():
        q.copy_(kvc.rotary_reference(pos, q, cs, neox))
        k.copy_(kvc.rotary_reference(pos, k, cs, neox))

    def torch_rotary_then_write():
        torch_rotary()
        kvc.kv_cache_update(k, v, kc, vc, slots)

    impls: list[tuple[str, Callable[[], object]]] = []
    if fuselane_ok:
        # fused on these inputs: q/k within rounding of the reference, and the cache exactly
        # what the reference write makes of the key it wrote back
        want_q = kvc.rotary_reference(pos, q, cs, neox)
        want_k = kvc.rotary_reference(pos, k, cs, neox)
        poison(base)
        fused()
        want, kw, vw = make_cache(batch.num_pages, torch.bfloat16)
        kvc.kv_cache_update_reference(k, v, kw, vw, slots)
        atol, rtol = ROTARY_TOL[torch.bfloat16]
        close = torch.allclose(q, want_q, atol=atol, rtol=rtol) and torch.allclose(
            k, want_k, atol=atol, rtol=rtol
        )
        bad = mismatches(base, want)
        if not close or bad:
            peers.note(
                f"{section} {case}: fused differs from the reference (q/k close: {close}, "
                f"{bad} cache elements differ); not timed"
            )
        else:
            impls.append(("fuselane", fused))
            impls.append(("fuselane-rotary+fuselane-write", fuselane_rotary_then_write))
    else:
        peers.note(f"{section} {case}: fuselane not timed (GPU check failed)")
    impls.append(("torch-rotary+fuselane-write", torch_rotary_then_write))
    if peers.vllm_write is not None:
        one = torch.ones(1, device=DEVICE)

        def torch_rotary_then_vllm():
            torch_rotary()
            peers.vllm_write(k, v, kc, vc, slots, "auto", one, one)

        impls.append(("torch-rotary+vllm-reshape_and_cache_flash", torch_rotary_then_vllm))
    timed = [
        (impl, fn)
        for impl, fn in impls
        if not impl.startswith("torch") or try_run(peers, f"{section} {case} {impl}", fn)
    ]
    run.time(section, case, timed, nbytes)


# ----------------------------------------------------------------------------------------------
# 4. Floor: what any implementation of the write spends at the same size
# ----------------------------------------------------------------------------------------------


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _copy_rows_kernel(
    k_ptr,  # [T, ROW_ELEMS] rows of key (row stride stride_src)
    v_ptr,  # [T, ROW_ELEMS] rows of value (same stride)
    dst_ptr,  # [T, 2 * ROW_ELEMS] contiguous: key row, then value row
    num_rows,
    stride_src,
    ROW_ELEMS: tl.constexpr,
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
):
    """fuselane's write without the slot: the same loads, stores to row r of a contiguous
    buffer. Its time is the floor of any kernel that reads the rows and writes them once."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows < num_rows)[:, None] & (cols < ROW_ELEMS)[None, :]
    src = rows[:, None] * stride_src + cols[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    v = tl.load(v_ptr + src, mask=mask)
    dst = rows[:, None] * (2 * ROW_ELEMS) + cols[None, :]
    tl.store(dst_ptr + dst, k, mask=mask)
    tl.store(dst_ptr + ROW_ELEMS + dst, v, mask=mask)


def bench_floor(run: Runner, tokens: int, gen: torch.Generator) -> None:
    section, case = "floor", case_name(tokens)
    batch = make_batch(tokens, gen)
    _, k, v = make_qkv(tokens, gen)
    _, kc, vc = make_cache(batch.num_pages, torch.bfloat16)
    slots = batch.slot_mapping
    dst = torch.empty(tokens, 2 * HKV * D, dtype=torch.bfloat16, device=DEVICE)
    rows, tile, warps = kvc.plan._write_launch_config(tokens, HKV * D)
    grid = (triton.cdiv(tokens, rows), triton.cdiv(HKV * D, tile))
    empty_x = torch.empty(1, device=DEVICE)

    def copy_no_slot():
        _copy_rows_kernel[grid](
            k, v, dst, tokens, k.stride(0), ROW_ELEMS=HKV * D, ROWS=rows, TILE=tile,
            num_warps=warps,
        )  # fmt: skip

    copy_no_slot()
    exact = torch.equal(dst[:, : HKV * D], k.flatten(1)) and torch.equal(
        dst[:, HKV * D :], v.flatten(1)
    )
    impls = [
        ("fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots)),
        ("empty-kernel", lambda: _empty_kernel[(1,)](empty_x)),
    ]
    if exact:
        impls.append(("triton-copy-no-slot", copy_no_slot))
    else:
        run.peers.note(f"{section} {case}: triton-copy-no-slot copied wrong bytes, not timed")
    run.time(section, case, impls, write_bytes(tokens, 2, 2))


# ----------------------------------------------------------------------------------------------
# 5. Sweeps
# ----------------------------------------------------------------------------------------------


def bench_sweep(run: Runner, tokens: int, gen: torch.Generator) -> None:
    section, case = "kv_write_sweep", case_name(tokens)
    batch = make_batch(tokens, gen)
    _, k, v = make_qkv(tokens, gen)
    base, kc, vc = make_cache(batch.num_pages, torch.bfloat16)
    want, kw, vw = make_cache(batch.num_pages, torch.bfloat16)
    slots = batch.slot_mapping
    kvc.kv_cache_update_reference(k, v, kw, vw, slots)
    nbytes = write_bytes(tokens, 2, 2)
    rule = kvc.plan._write_launch_config(tokens, HKV * D)

    def launcher(**kw):
        return lambda: kvc.launch._launch_write(k, v, kc, vc, slots, None, None, False, **kw)

    impls = [("fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots))]
    for rows in SWEEP_ROWS:
        for warps in SWEEP_WARPS:
            if (rows, warps) != (rule[0], rule[2]):
                name = f"fuselane[rows={rows},warps={warps}]"
                impls.append((name, launcher(rows_per_program=rows, num_warps=warps)))
    impls.append(("fuselane[addr64]", launcher(offsets_64=True, flat_slots=False)))
    impls.append(("fuselane[evict_first]", launcher(load_eviction="evict_first")))
    timed = []
    for name, fn in impls:
        poison(base)
        if not try_run(run.peers, f"{section} {case} {name}", fn):
            continue
        if mismatches(base, want):
            run.peers.note(f"{section} {case} {name}: wrong result, not timed")
            continue
        timed.append((name, fn))
    run.time(section, case, timed, nbytes)
    print(f"  (rule at {tokens} tokens: rows={rule[0]} tile={rule[1]} warps={rule[2]})", flush=True)


def bench_fp8_sweep(run: Runner, tokens: int, gen: torch.Generator) -> None:
    section, case = "kv_write_fp8_sweep", case_name(tokens)
    batch = make_batch(tokens, gen)
    _, k, v = make_qkv(tokens, gen)
    base, kc, vc = make_cache(batch.num_pages, FP8)
    want, kw, vw = make_cache(batch.num_pages, FP8)
    slots = batch.slot_mapping
    scales = (torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE))
    kvc.kv_cache_update_reference(k, v, kw, vw, slots, *scales)
    nbytes = write_bytes(tokens, 2, 1)

    def launcher(**kw):
        return lambda: kvc.launch._launch_write(k, v, kc, vc, slots, *scales, True, **kw)

    impls = [
        ("fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots, *scales)),
        ("fuselane[emulated]", launcher(emulate_e4m3=True)),
        ("fuselane[addr64]", launcher(offsets_64=True, flat_slots=False)),
    ]
    timed = []
    for name, fn in impls:
        poison(base)
        if not try_run(run.peers, f"{section} {case} {name}", fn):
            continue
        if mismatches(base, want):
            run.peers.note(f"{section} {case} {name}: wrong result, not timed")
            continue
        timed.append((name, fn))
    run.time(section, case, timed, nbytes)


# ----------------------------------------------------------------------------------------------
# 6. Goals
# ----------------------------------------------------------------------------------------------


def goals(report: harness.Report, empty_us: float) -> list[str]:
    rows = report.as_dicts()

    def find(section, case, impl):
        return next(
            (r for r in rows if (r["section"], r["case"], r["impl"]) == (section, case, impl)), None
        )

    lines = []

    def goal(name: str, ok: bool | None, detail: str) -> None:
        word = "n/a " if ok is None else ("PASS" if ok else "MISS")
        lines.append(f"GOAL {word} {name}: {detail}")

    for section in ("kv_write", "kv_write_fp8"):
        for n in TOKENS:
            case = case_name(n)
            ours = find(section, case, "fuselane")
            peers = [
                r
                for r in rows
                if r["section"] == section and r["case"] == case and r["impl"] != "fuselane"
            ]
            if ours is None:
                goal(f"{section} {case} faster than every peer", None, "fuselane not timed")
                continue
            slowest_ratio = min((r["peer_over_fuselane"] for r in peers), default=None)
            goal(
                f"{section} {case} faster than every peer",
                None if slowest_ratio is None else slowest_ratio > 1.0,
                ", ".join(f"{r['impl']} {r['peer_over_fuselane']}x" for r in peers)
                or "no peer ran",
            )
            if section == "kv_write" and n <= GOAL_GAP_MAX_TOKENS:
                gap = ours["us"] - empty_us
                goal(
                    f"{case} within {GOAL_GAP_US} us of the empty kernel",
                    gap <= GOAL_GAP_US,
                    f"gap {gap:.3f} us",
                )
            if section == "kv_write" and n == max(TOKENS):
                pct = ours.get("pct_copy_ceiling")
                goal(
                    f"{case} >= {GOAL_PCT_COPY}% of copy bandwidth",
                    pct is not None and pct >= GOAL_PCT_COPY,
                    f"{pct}%",
                )
            if section == "kv_write_fp8":
                bf16 = find("kv_write", case, "fuselane")
                if bf16 is not None:
                    ratio = ours["us"] / bf16["us"]
                    goal(
                        f"{case} fp8 within 10% of bf16",
                        ratio <= GOAL_FP8_SLOWDOWN,
                        f"fp8/bf16 {ratio:.3f}",
                    )
    rope_cases = [rope_case_name(n) for n in ROPE_TOKENS]
    rope_cases += [rope_case_name(n, neox=False) for n in ROPE_GPTJ_TOKENS]
    for case in rope_cases:
        ours = find("rope_kv_write", case, "fuselane")
        separate = [
            r
            for r in rows
            if r["section"] == "rope_kv_write" and r["case"] == case and r["impl"] != "fuselane"
        ]
        if ours is None or not separate:
            goal(f"rope {case} faster than separate rotary + write", None, "not timed")
            continue
        goal(
            f"rope {case} faster than separate rotary + write",
            min(r["peer_over_fuselane"] for r in separate) > 1.0,
            ", ".join(f"{r['impl']} {r['peer_over_fuselane']}x" for r in separate),
        )
    # Not goals: where the write stands against what any implementation must spend.
    for n in TOKENS:
        case = case_name(n)
        ours = find("floor", case, "fuselane")
        copy = find("floor", case, "triton-copy-no-slot")
        empty = find("floor", case, "empty-kernel")
        if ours is None or copy is None or empty is None:
            continue
        lines.append(
            f"FLOOR {case}: fuselane {ours['us']:.3f} us, copy of the same bytes without the "
            f"slot lookup {copy['us']:.3f} us, empty kernel {empty['us']:.3f} us: "
            f"fuselane - copy {ours['us'] - copy['us']:+.3f} us, "
            f"copy - empty {copy['us'] - empty['us']:+.3f} us"
        )
    return lines


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON result")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-rule sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kv_cache needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    report = harness.Report("kv_cache")
    print(f"device: {report.info}", flush=True)

    copy_tbps = harness.copy_ceiling_tbps()
    empty_us = harness.empty_kernel_ms() * 1e3
    report.ceilings = {"copy_tbps": round(copy_tbps, 3), "empty_kernel_us": round(empty_us, 3)}
    print(f"ceiling: copy {copy_tbps:.3f} TB/s, empty Triton kernel {empty_us:.3f} us", flush=True)

    run = Runner(report, empty_us)
    ok = run_checks(run.peers)
    print(f"checks done at {time.perf_counter() - t_start:.0f} s", flush=True)

    for n in TOKENS:
        bench_write(run, n, fp8=False, fuselane_ok=ok["write"], gen=gen)
    for n in TOKENS:
        bench_write(run, n, fp8=True, fuselane_ok=ok["fp8"], gen=gen)
    for n in ROPE_TOKENS:
        bench_rope(run, n, fuselane_ok=ok["rope"], gen=gen)
    for n in ROPE_GPTJ_TOKENS:
        bench_rope(run, n, fuselane_ok=ok["rope"], gen=gen, neox=False)
    if ok["write"]:
        for n in TOKENS:
            bench_floor(run, n, gen)
    print(f"timed sections done at {time.perf_counter() - t_start:.0f} s", flush=True)
    if not args.no_sweep and ok["write"]:
        for n in SWEEP_TOKENS:
            bench_sweep(run, n, gen)
    if not args.no_sweep and ok["fp8"]:
        for n in FP8_SWEEP_TOKENS:
            bench_fp8_sweep(run, n, gen)
    print(f"sweeps done at {time.perf_counter() - t_start:.0f} s", flush=True)

    goal_lines = goals(report, empty_us)
    report.notes.extend(goal_lines)
    print("\n".join(goal_lines))
    for out in (args.out, None):
        print(f"wrote {report.write(out)}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(report.table())
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

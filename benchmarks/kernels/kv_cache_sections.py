"""The KV-cache script's timed sections (bench_kv_cache): kv_write (bf16), kv_write_fp8,
rope_kv_write, and the floor of a write, with the peers and the runner that times them.

Each case first verifies fuselane's cache against the reference on the timed inputs (and each
peer's cache against the reference, reported in the notes), then times fuselane and every peer
by CUDA-graph replay, ROUNDS times in interleaved order, reporting the median round (and every
round's time). Floor: what any implementation of the write must spend at the same size, next to
fuselane: an empty kernel, and a Triton copy of the same key/value bytes to a contiguous buffer
with no slot lookup (same launch shape as fuselane's rule).

Peers: vLLM's `triton_reshape_and_cache_flash`, FlashInfer's `append_paged_kv_cache` (bf16
only: it has no quantize-on-write), torch `index_copy_` (fp8: after the reference quantizer);
for RoPE, torch's rotary (the reference) followed by fuselane's or vLLM's write.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels import kv_cache_workload as kvw
from fuselane.benchmarks.kernels.kv_cache_workload import (
    DECODE_MAX_CONTEXT,
    FP8,
    HKV,
    K_SCALE,
    PREFILL_CHUNK,
    ROTARY_TOL,
    V_SCALE,
    D,
    case_name,
    flashinfer_append,
    make_batch,
    make_cache,
    make_qkv,
    mismatches,
    poison,
    rope_bytes,
    rope_case_name,
    rope_cos_sin,
    rotary_then,
    torch_write,
    write_bytes,
)
from fuselane.benchmarks.kernels.peers import FLASHINFER, RESHAPE_AND_CACHE_FLASH, import_peer
from fuselane.kernels import kv_cache as kvc

ROUNDS = 3  # each case's impls are timed this many times, interleaved; the median round counts

Impls = list[tuple[str, Callable[[], object]]]


class Peers(family_script.ScriptPeers):
    """vLLM's and FlashInfer's KV writes, where they import, and the script's notes."""

    def __init__(self, report: harness.Report) -> None:
        super().__init__(report)
        self.vllm_write: Callable | None = import_peer(RESHAPE_AND_CACHE_FLASH, self.note)
        self.flashinfer = import_peer(FLASHINFER, self.note)


class Runner:
    """Times a case's implementations and records their rows."""

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
    k_scale = torch.tensor([K_SCALE if fp8 else 1.0], device=kvw.DEVICE)
    v_scale = torch.tensor([V_SCALE if fp8 else 1.0], device=kvw.DEVICE)
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

    impls.append(torch_write(k, v, kc, vc, slots, scales or None))

    if peers.vllm_write is not None:
        kv_dtype = "fp8" if fp8 else "auto"

        def vllm_peer():
            peers.vllm_write(k, v, kc, vc, slots, kv_dtype, k_scale, v_scale)

        impls.append(("vllm-triton-reshape_and_cache_flash", vllm_peer))

    if peers.flashinfer is not None and not fp8:
        flashinfer_peer = flashinfer_append(peers.flashinfer, batch, k, v, kc, vc)
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
            if not family_script.try_run(peers.note, f"{section} {case} {impl}", fn):
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
            kvc.Rotary(pos, q, cs, neox),
            kvc.KVWrite(k, v, kc, vc, slots),
            False,
            write_cache=False,
        )
        kvc.kv_cache_update(k, v, kc, vc, slots)

    def write():
        kvc.kv_cache_update(k, v, kc, vc, slots)

    torch_rotary_then_write = rotary_then(pos, q, k, cs, neox, write)

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
        one = torch.ones(1, device=kvw.DEVICE)

        def vllm_write():
            peers.vllm_write(k, v, kc, vc, slots, "auto", one, one)

        torch_rotary_then_vllm = rotary_then(pos, q, k, cs, neox, vllm_write)
        impls.append(("torch-rotary+vllm-reshape_and_cache_flash", torch_rotary_then_vllm))
    timed = [
        (impl, fn)
        for impl, fn in impls
        if not impl.startswith("torch")
        or family_script.try_run(peers.note, f"{section} {case} {impl}", fn)
    ]
    run.time(section, case, timed, nbytes)


# ----------------------------------------------------------------------------------------------
# Floor: what any implementation of the write spends at the same size
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
    dst = torch.empty(tokens, 2 * HKV * D, dtype=torch.bfloat16, device=kvw.DEVICE)
    rows, tile, warps = kvc.plan._write_launch_config(tokens, HKV * D)
    grid = (triton.cdiv(tokens, rows), triton.cdiv(HKV * D, tile))
    empty_x = torch.empty(1, device=kvw.DEVICE)
    meta = dict(ROW_ELEMS=HKV * D, ROWS=rows, TILE=tile, num_warps=warps)

    def copy_no_slot():
        _copy_rows_kernel[grid](k, v, dst, tokens, k.stride(0), **meta)

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

"""The KV-cache script's sweeps (bench_kv_cache), to fill the tables in kernels/kv_cache/plan.py.

- kv_write_sweep: the bf16 write at other (tokens per program, warps) settings than the launch
  rule picks, and the rule's setting with int64 block-and-offset addressing (`[addr64]`) and
  with evict-first key/value loads (`[evict_first]`);
- kv_write_fp8_sweep: the fp8 write with the interpreter's exact rounding emulation
  (`[emulated]`) and with int64 addressing.

Each setting's cache must equal the reference's bit for bit before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.kv_cache_sections import Impls, Runner
from fuselane.benchmarks.kernels.kv_cache_workload import (
    FP8,
    HKV,
    D,
    case_name,
    fp8_scales,
    make_batch,
    make_cache,
    make_qkv,
    mismatches,
    poison,
    write_bytes,
)
from fuselane.kernels import kv_cache as kvc

SWEEP_TOKENS = (1, 256, 1024, 2048, 4096, 32768)
SWEEP_ROWS = (1, 2, 4, 8, 16)
SWEEP_WARPS = (2, 4, 8)
FP8_SWEEP_TOKENS = (1, 256, 4096, 32768)


def time_exact(
    run: Runner,
    section: str,
    case: str,
    impls: Impls,
    base: torch.Tensor,
    want: torch.Tensor,
    nbytes: int,
) -> None:
    """Time the impls whose cache (`base`, poisoned before each) equals `want` bit for bit."""
    timed = []
    for name, fn in impls:
        poison(base)
        if not family_script.try_run(run.peers.note, f"{section} {case} {name}", fn):
            continue
        if mismatches(base, want):
            run.peers.note(f"{section} {case} {name}: wrong result, not timed")
            continue
        timed.append((name, fn))
    run.time(section, case, timed, nbytes)


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

    def launcher(**kw: object) -> Callable[[], object]:
        return lambda: kvc.launch._launch_write(kvc.KVWrite(k, v, kc, vc, slots), False, **kw)

    impls = [("fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots))]
    for rows in SWEEP_ROWS:
        for warps in SWEEP_WARPS:
            if (rows, warps) != (rule[0], rule[2]):
                name = f"fuselane[rows={rows},warps={warps}]"
                impls.append((name, launcher(rows_per_program=rows, num_warps=warps)))
    impls.append(("fuselane[addr64]", launcher(offsets_64=True, flat_slots=False)))
    impls.append(("fuselane[evict_first]", launcher(load_eviction="evict_first")))
    time_exact(run, section, case, impls, base, want, nbytes)
    print(f"  (rule at {tokens} tokens: rows={rule[0]} tile={rule[1]} warps={rule[2]})", flush=True)


def bench_fp8_sweep(run: Runner, tokens: int, gen: torch.Generator) -> None:
    section, case = "kv_write_fp8_sweep", case_name(tokens)
    batch = make_batch(tokens, gen)
    _, k, v = make_qkv(tokens, gen)
    base, kc, vc = make_cache(batch.num_pages, FP8)
    want, kw, vw = make_cache(batch.num_pages, FP8)
    slots = batch.slot_mapping
    scales = fp8_scales()
    kvc.kv_cache_update_reference(k, v, kw, vw, slots, *scales)
    nbytes = write_bytes(tokens, 2, 1)

    def launcher(**kw: object) -> Callable[[], object]:
        return lambda: kvc.launch._launch_write(
            kvc.KVWrite(k, v, kc, vc, slots, *scales), True, **kw
        )

    impls = [
        ("fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots, *scales)),
        ("fuselane[emulated]", launcher(emulate_e4m3=True)),
        ("fuselane[addr64]", launcher(offsets_64=True, flat_slots=False)),
    ]
    time_exact(run, section, case, impls, base, want, nbytes)

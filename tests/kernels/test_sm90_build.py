"""The GPU kernels built for sm_90a on a machine without a GPU (Triton's NVIDIA backend and its
ptxas run on the CPU): front-end, layout and register-allocation errors of the Hopper decode
and prefill kernels' cache and option variants, and of the fp8 query path, show here rather than
at a GPU session's start-up. The runtime checks are the GPU tests (tests/kernels/test_attention*.py
on an sm_90 device). The builds run in one subprocess with the interpreter off (the other
tests import the kernels interpreted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget

from fuselane.kernels._triton_compat import gluon_hopper_missing

SM90 = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "cu_q_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "counter_ptr": "*i32",
                 "sched_ptr": "*i32"}  # fmt: skip
FP32_POINTERS = ("part_o_ptr", "part_ml_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr")


def _compile(fn, source_cls, constants: dict, kv: str, options: dict):
    """`fn` compiled for sm_90a with bf16 q/out, a `kv` cache and 16-byte aligned pointers and
    strides (as every real launch is specialized)."""
    names = fn.arg_names
    types = {n: "*bf16" for n in names if n.endswith("_ptr")}
    types.update(POINTER_TYPES, k_ptr=f"*{kv}", v_ptr=f"*{kv}")
    types.update({n: "*fp32" for n in FP32_POINTERS}, scale="fp32", softcap="fp32")
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    aligned = [
        i for i, n in enumerate(names) if n.endswith("_ptr") or n.startswith("stride")
    ]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = source_cls(fn, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(src, target=SM90, options=options)


def _fp8_decode_ptx() -> str:
    """The PTX of the Triton decode kernel over an fp8 cache with a bf16 q, in the balanced
    split the rule gives split batches (reading its schedule)."""
    from triton.compiler import ASTSource

    from fuselane.kernels.attention import decode

    constants = dict(
        NUM_Q_HEADS=32, GROUP=4, QPOS=1, BLOCK_M=16, HEAD_SIZE=128, HEAD_PAD=128, PAGE=16,
        TILE_N=128, SPLIT=True, FUSED_REDUCE=True, MERGE_M=4, RED_SPLITS=16, HEAD_FAST=True,
        BALANCED=True, MAX_Q=0, SLIDING_WINDOW=0, USE_SOFTCAP=False, USE_SINKS=False, KV_FP8=True,
        UPCAST_DOT=False, OFFSETS_FROM_TILE=True,
    )  # fmt: skip
    kernel = _compile(decode._decode_kernel, ASTSource, constants, "fp8e4nv",
                      dict(num_warps=4, num_stages=3))  # fmt: skip
    return kernel.asm["ptx"]


def _schedule_kernel_builds() -> bool:
    """The balanced split's schedule kernel, as the decode launches of a windowed mixed batch
    use it, built through ptxas."""
    from triton.compiler import ASTSource

    from fuselane.kernels.attention import balance

    constants = dict(TILE_N=128, MAX_Q=8, SLIDING_WINDOW=4096, ITEMS=balance.SCHEDULE_ITEMS,
                     SCAN=balance.BALANCE_SCAN.value)  # fmt: skip
    kernel = _compile(balance._schedule_kernel, ASTSource, constants, "bf16", dict(num_warps=4))
    return bool(kernel.asm["cubin"])


DECODE_WS_VARIANTS = [  # (kv, head, tile, slots, window, softcap, sinks, split)
    ("bf16", 128, 128, 2, 0, False, False, True),  # the rule's bf16 tile
    ("bf16", 256, 64, 2, 4096, True, False, True),  # Gemma-2: head 256, window, soft cap
    ("fp8e4nv", 128, 128, 4, 0, False, True, False),  # fp8 staging, sinks unsplit
    ("fp8e4nv", 256, 64, 3, 1000, True, True, True),  # every option at once
]


def _decode_ws_shared(kv, head, tile, slots, window, softcap, sinks, split) -> int:
    """Shared memory of one variant of Hopper's decode kernel, built through ptxas."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from fuselane.kernels.attention import decode_ws

    group = 4 if head == 128 else 2
    constants = dict(
        NUM_Q_HEADS=8 * group, GROUP=group, BLOCK_N=tile, HEAD=head, PAGE=16, NUM_BUF=slots,
        SPLIT=split, MERGE_M=group, RED_SPLITS=8, HEAD_FAST=False, SLIDING_WINDOW=window,
        USE_SOFTCAP=softcap, USE_SINKS=sinks, KV_FP8=kv == "fp8e4nv",
        KV_VEC=16 if kv == "fp8e4nv" else 8,
    )  # fmt: skip
    kernel = _compile(decode_ws._decode_ws_kernel, GluonASTSource, constants, kv,
                      dict(num_warps=4))  # fmt: skip
    assert kernel.asm["cubin"]
    return kernel.metadata.shared


# Hopper's prefill kernel: (head size, window, soft cap, sinks, KV dtype[, rows]), each at its
# tile for the head size or with that many rows.
PREFILL_WS_VARIANTS = [
    (128, 4096, False, True, "bf16"),  # window and sinks (Mistral-like, gpt-oss-like)
    (256, 4096, True, True, "bf16"),  # head size 256, every option at once (Gemma 2 and more)
    (128, 0, False, False, "fp8e4nv"),  # fp8 staging, two staging buffers
    (256, 4096, True, True, "fp8e4nv"),  # fp8 at head size 256 (one staging buffer), options
    (128, 4096, False, True, "fp8e4nv", 128),  # fp8 in the 128-row tile (short prefills)
]


def _prefill_ws_shared(head, window, softcap, sinks, kv, rows=None) -> int:
    """Shared memory of one variant of Hopper's prefill kernel, built through ptxas."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from fuselane.kernels.attention import plan, prefill_ws

    block_m, block_n, warps, slots = plan.prefill_ws_tile(head)
    block_m = rows or block_m
    group = 4 if head == 128 else 2
    kv_bytes = 1 if kv == "fp8e4nv" else 2
    compute_regs, load_regs = prefill_ws.WS_REGISTERS[head]
    constants = dict(
        GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD=head,
        PAGE=16, MIN_Q=8, NUM_BUF=slots, HEAD_FAST=True, SLIDING_WINDOW=window,
        USE_SOFTCAP=softcap, USE_SINKS=sinks, KV_FP8=kv_bytes == 1, KV_VEC=16 // kv_bytes,
        STAGE_BUF=max(1, plan.prefill_ws_stage_buffers(head, kv_bytes)),
        COMPUTE_REGS=compute_regs, LOAD_REGS=load_regs,
    )  # fmt: skip
    kernel = _compile(prefill_ws._prefill_ws_kernel, GluonASTSource, constants, kv,
                      dict(num_warps=warps))  # fmt: skip
    assert kernel.asm["cubin"]
    return kernel.metadata.shared


def _main() -> None:
    """The subprocess: every build, as one JSON line."""
    out: dict[str, object] = {"fp8_ptx": _fp8_decode_ptx(), "schedule": _schedule_kernel_builds()}
    if gluon_hopper_missing() is None:
        out["decode_ws_shared"] = [_decode_ws_shared(*v) for v in DECODE_WS_VARIANTS]
        out["prefill_ws_shared"] = [_prefill_ws_shared(*v) for v in PREFILL_WS_VARIANTS]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def builds() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run(
        [sys.executable, "-c", "from tests.kernels.test_sm90_build import _main; _main()"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_fp8_query_is_scaled_in_fp32_before_fp16(builds):
    """An fp8 cache meets a bf16 q in fp16 (decode._fp8_query): the 2^-8 scaling must be an
    fp32 multiply ahead of the conversion. With a constant multiplier LLVM moved it behind the
    conversion (mul.f16x2), and |q| > 65504 became inf, then NaN, on the GPU."""
    ptx = builds["fp8_ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx  # the one-instruction fp8 -> fp16 conversion
    q_convert = re.search(r"cvt\.f32\.bf16[^\n]*\n(?:[^\n]*\n){0,6}?[^\n]*cvt\.rn\.f16x2\.f32", ptx)
    assert q_convert is not None and "mul.f32" in q_convert.group(0), "q scaled after fp16"
    assert "mul.f16x2" not in ptx


def test_balanced_schedule_kernel_builds(builds):
    assert builds["schedule"] is True


@pytest.mark.skipif(gluon_hopper_missing() is not None, reason="no Gluon Hopper API")
@pytest.mark.parametrize("index", range(len(DECODE_WS_VARIANTS)))
def test_hopper_decode_kernel_builds(builds, index):
    """Hopper's warp-specialized decode kernel, each cache and option family, through ptxas;
    its shared memory as `plan.decode_ws_smem_bytes` counts it (plus barriers)."""
    from fuselane.kernels.attention import plan

    kv, head, tile, slots, *_ = DECODE_WS_VARIANTS[index]
    counted = plan.decode_ws_smem_bytes(tile, head, slots, 1 if kv == "fp8e4nv" else 2)
    assert counted <= builds["decode_ws_shared"][index] <= counted + 1024


@pytest.mark.skipif(gluon_hopper_missing() is not None, reason="no Gluon Hopper API")
@pytest.mark.parametrize("index", range(len(PREFILL_WS_VARIANTS)))
def test_hopper_prefill_kernel_builds(builds, index):
    """Hopper's warp-specialized prefill kernel with its options and caches, at head sizes 128
    and 256, through ptxas; its shared memory as `plan.prefill_ws_smem_bytes` counts it (plus
    barriers), within the block's limit."""
    from fuselane.kernels.attention import plan

    head, _, _, _, kv, *rows = PREFILL_WS_VARIANTS[index]
    block_m, block_n, _, slots = plan.prefill_ws_tile(head)
    block_m = rows[0] if rows else block_m
    counted = plan.prefill_ws_smem_bytes(block_m, block_n, head, slots, 1 if kv == "fp8e4nv" else 2)
    assert counted <= builds["prefill_ws_shared"][index] <= counted + 1024
    assert builds["prefill_ws_shared"][index] <= plan.SMEM_PER_BLOCK_MAX

"""Hopper's warp-specialized attention kernels (`kernels/attention/prefill_ws.py`,
`kernels/attention/decode_ws.py`) against the fp32 reference. Gluon kernels do not run under
Triton's interpreter: the kernel cases need an sm_90 GPU (they run in the GPU sessions:
`pytest tests/kernels/test_attention_ws.py`); the planning and refusal cases run everywhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fuselane.kernels import attention as attn
from fuselane.kernels.attention import prefill_ws
from tests.device import DEVICE
from tests.kernels.test_attention import (
    attention_options,
    make_batch,
    nan_out,
    paged_batch,
    plan_for,
    run_case,
    workspace,
)

HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE)[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (Gluon, wgmma)")

WS_CASES = [
    # (Hq, Hkv, D, block, q dtype, q_lens, seq_lens, layout)
    # pure prefill: partial last q block, page and tile crossings, a 1-token sequence
    (32, 8, 128, 16, torch.bfloat16, [700, 17, 1, 64], [700, 17, 1, 64], "nhd"),
    # long: many interior tiles before the diagonal
    (8, 2, 128, 16, torch.bfloat16, [2100], [2100], "nhd"),
    # chunked prefill after a cached prefix (diagonal mid-tile), head-major cache
    (16, 2, 128, 32, torch.float16, [300, 90], [1300, 2000], "hnd"),
    # MHA and GQA 8, head size 64, 64-slot pages
    (4, 4, 64, 64, torch.bfloat16, [257, 129], [257, 700], "nhd"),
    (16, 2, 64, 16, torch.float16, [513], [777], "nhd"),
    # mixed: decode and verify rows belong to the decode kernel in the same call
    (32, 8, 128, 16, torch.bfloat16, [1, 5, 333, 1, 100], [900, 40, 333, 1, 4000], "nhd"),
]


def ws_plan(batch: dict, ws, **prefill_changes) -> attn.LaunchPlan:
    """The rule's plan for `batch` with the warp-specialized prefill kernel (defaults: 256-row
    tile, 64 keys, 4 slots, kv-head-fastest grid)."""
    changes = dict(block_m=256, block_n=64, num_warps=4, num_stages=4, head_fast=True)
    changes.update(prefill_changes, warp_specialized=True)
    return plan_for(batch, ws, prefill_changes=changes)


def ws_batch(case, seed: int = 0) -> dict:
    Hq, Hkv, D, bs, q_dtype, q_lens, seq_lens, layout = case
    return make_batch(
        q_lens, seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_size=D, block_size=bs,
        q_dtype=q_dtype, layout=layout, seed=seed or sum(seq_lens),
    )  # fmt: skip


def assert_repeats_agree(
    batch: dict, ws, plan: attn.LaunchPlan, times: int = 20, **options
) -> None:
    """`plan` on `batch` (with `paged_attention`'s option keywords): checked against the
    reference once, then launched `times` more into fresh poisoned outputs, each equal to the
    first to the bit (a barrier-phase, slot-reuse or split-merge race would show as a difference
    between launches)."""
    first = run_case(batch, workspace=ws, plan=plan, **options)
    rows = batch["num_rows"]
    b = batch
    for _ in range(times):
        out = nan_out(b["q"])
        attn.run._run(
            b["q"], b["key_cache"], b["value_cache"], out, paged_batch(b),
            attention_options(b, **options), ws, plan=plan,
        )  # fmt: skip
        assert torch.equal(out[:rows], first[:rows])


@needs_hopper
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-D{c[2]}-bs{c[3]}"
                         f"-{str(c[4])[6:]}-q{'_'.join(map(str, c[5]))}")  # fmt: skip
def test_ws_prefill_matches_reference(case):
    batch = ws_batch(case)
    ws = workspace(case[0], case[2])
    run_case(batch, workspace=ws, plan=ws_plan(batch, ws))


@needs_hopper
@pytest.mark.parametrize(
    "changes",
    [
        dict(num_stages=2),
        dict(num_stages=3),
        dict(head_fast=False),
        dict(block_m=128),
        dict(block_m=128, block_n=128, num_stages=2),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_ws_prefill_configs(changes):
    case = WS_CASES[0]
    batch = ws_batch(case, seed=7)
    ws = workspace(case[0], case[2])
    run_case(batch, workspace=ws, plan=ws_plan(batch, ws, **changes))


@needs_hopper
def test_ws_prefill_repeated_launches_agree():
    """Many launches on one batch give bit-identical outputs (a barrier-phase or slot-reuse
    race would show as a difference between runs)."""
    case = WS_CASES[1]
    batch = ws_batch(case, seed=3)
    ws = workspace(case[0], case[2])
    plan = ws_plan(batch, ws, num_stages=2)
    assert_repeats_agree(batch, ws, plan)


def option_case_id(case: tuple) -> str:
    """The test id of an (Hq, Hkv, D, block, q dtype, q_lens, seq_lens, options) case."""
    Hq, Hkv, D, _, q_dtype, _, _, options = case
    return f"Hq{Hq}-Hkv{Hkv}-D{D}-{str(q_dtype)[6:]}-" + ",".join(sorted(options))


WS_PREFILL_OPTION_CASES = [
    # (Hq, Hkv, D, block, q dtype, q_lens, seq_lens, options)
    # a window longer than the q block: edge tiles, interior, diagonal; a 1-token sequence
    (
        32,
        8,
        128,
        16,
        torch.bfloat16,
        [700, 17, 1, 300],
        [700, 17, 1, 1300],
        dict(sliding_window=200),
    ),
    # a window shorter than the q block (64 positions): edge and diagonal tiles meet
    (32, 8, 128, 16, torch.bfloat16, [500, 90], [500, 2000], dict(sliding_window=40)),
    # sinks, chunked prefill after a cached prefix
    (32, 8, 128, 32, torch.float16, [300, 90], [1300, 2000], dict(sinks=True)),
    # head size 256 with a soft cap (Gemma 2), and with every option at once
    (16, 8, 256, 16, torch.bfloat16, [700, 33, 1], [700, 1500, 1], dict(softcap=50.0)),
    (
        16,
        8,
        256,
        16,
        torch.float16,
        [1100, 64],
        [1900, 64],
        dict(sliding_window=777, softcap=30.0, sinks=True),
    ),
    (8, 8, 256, 16, torch.bfloat16, [2100], [2100], dict()),
    # head size 64, many query heads per kv head, a short window and sinks (gpt-oss-like)
    (64, 8, 64, 16, torch.bfloat16, [600, 130], [600, 900], dict(sliding_window=128, sinks=True)),
]


@needs_hopper
@pytest.mark.parametrize(
    "case",
    WS_PREFILL_OPTION_CASES,
    ids=option_case_id,
)
def test_ws_prefill_options_match_reference(case):
    """Sliding window, soft cap and sinks, head sizes 64 / 128 / 256, in the warp-specialized
    prefill kernel at its tile for the head size: against the reference, then repeated
    launches bit-identical."""
    run_ws_prefill_option_case(case, kv_dtype=None)


def run_ws_prefill_option_case(
    case: tuple, kv_dtype: torch.dtype | None, block_m: int | None = None
) -> None:
    """One (Hq, Hkv, D, block, q dtype, q_lens, seq_lens, options) case on a cache of q's dtype
    or `kv_dtype`, at the warp-specialized prefill kernel's tile for the head size (`block_m`:
    with that many rows instead; options' `sinks=True`: random per-head sinks): against the
    reference, then 5 repeats bit-identical."""
    Hq, Hkv, D, bs, q_dtype, q_lens, seq_lens, options = case
    batch = make_batch(
        q_lens, seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_size=D, block_size=bs,
        q_dtype=q_dtype, kv_dtype=kv_dtype, seed=sum(seq_lens) + D + (kv_dtype is not None),
    )  # fmt: skip
    options = dict(options)
    if options.pop("sinks", False):
        gen = torch.Generator().manual_seed(D)
        options["sinks"] = (torch.randn(Hq, generator=gen) * 2.0).to(DEVICE)
    ws = workspace(Hq, D)
    rows, block_n, warps, slots = attn.prefill_ws_tile(D)
    plan = ws_plan(batch, ws, block_m=block_m or rows, block_n=block_n, num_warps=warps,
                   num_stages=slots)  # fmt: skip
    assert_repeats_agree(batch, ws, plan, times=5, **options)


_BF16, _FP16, _FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
WS_PREFILL_SMALL_TILE_CASES = [
    # (case as above, KV cache dtype or None for q's): the 128-row tile the rule takes for
    # launches of at most one wave of the 256-row one
    (
        (32, 8, 128, 16, _BF16, [700, 17, 1, 300], [700, 17, 1, 1300], dict(sliding_window=200)),
        None,
    ),
    ((32, 8, 128, 32, _FP16, [300, 90], [1300, 2000], dict(sliding_window=40, sinks=True)), None),
    ((8, 1, 128, 16, _BF16, [2100], [2100], dict(sinks=True)), _FP8),
    ((28, 4, 128, 16, _BF16, [513, 64], [513, 4160], dict()), _FP8),
    ((32, 8, 64, 16, _BF16, [1024, 5], [1024, 300], dict(sliding_window=256)), None),
]


@needs_hopper
@pytest.mark.parametrize(
    "case,kv_dtype",
    WS_PREFILL_SMALL_TILE_CASES,
    ids=lambda c: option_case_id(c) if isinstance(c, tuple) else str(c)[6:],
)
def test_ws_prefill_small_tile_matches_reference(case, kv_dtype):
    """The warp-specialized prefill kernel's 128-row tile (64 rows per compute warpgroup), with
    windows, sinks, a chunk after a cached prefix, a group of 7 and fp8 caches: against the
    reference, then repeated launches bit-identical."""
    run_ws_prefill_option_case(case, kv_dtype=kv_dtype, block_m=attn.PREFILL_WS_SMALL_ROWS)


WS_PREFILL_FP8_CASES = [
    # (Hq, Hkv, D, block, q dtype, q_lens, seq_lens, options): fp8 e4m3 caches, scales != 1
    (32, 8, 128, 16, torch.bfloat16, [700, 17, 1, 64], [700, 17, 1, 64], dict()),
    (16, 2, 128, 32, torch.float16, [300, 90], [1300, 2000], dict(sliding_window=200)),
    (8, 1, 128, 16, torch.bfloat16, [2100], [2100], dict(sinks=True)),
    (16, 8, 256, 16, torch.bfloat16, [700, 33], [700, 1500], dict(softcap=50.0)),
    (16, 8, 256, 16, torch.bfloat16, [1100], [1900], dict(sliding_window=40, softcap=30.0)),
    (64, 8, 64, 16, torch.bfloat16, [600, 130], [600, 900], dict(sliding_window=128, sinks=True)),
]


@needs_hopper
@pytest.mark.parametrize(
    "case",
    WS_PREFILL_FP8_CASES,
    ids=option_case_id,
)
def test_ws_prefill_fp8_cache_matches_reference(case):
    """An fp8 e4m3 cache in the warp-specialized prefill kernel (fp8 ring slots, each compute
    warpgroup converting half of every tile into the shared staging buffers; per-tensor
    scales), head sizes 64 / 128 / 256 with options, at its tile for the head size: against
    the reference, then repeated launches bit-identical (a staging race would show there)."""
    run_ws_prefill_option_case(case, kv_dtype=torch.float8_e4m3fn)


def test_ws_plan_refused_where_the_kernel_cannot_run():
    """A plan naming the warp-specialized kernel for a batch it cannot run raises, naming what
    it supports (on the CPU: every batch; on a GPU: head size 96)."""
    Hq, Hkv, D = 4, 4, 96 if HOPPER else 64
    batch = make_batch(
        [257, 129], [257, 700], num_q_heads=Hq, num_kv_heads=Hkv, head_size=D, block_size=64,
        seed=5,
    )  # fmt: skip
    ws = workspace(Hq, D)
    plan = ws_plan(batch, ws)
    with pytest.raises(ValueError, match="warp-specialized prefill kernel runs sm_90"):
        run_case(batch, workspace=ws, plan=plan)


def test_ws_supports_only_its_configurations():
    """`prefill_ws.supports` (any option runs): a q-dtype or fp8 e4m3 cache at head sizes
    64 / 128 / 256 on sm_90; CPU tensors, other head sizes, mixed-dtype caches never."""
    q = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    kc = torch.empty(3, 16, 2, 128, dtype=torch.bfloat16)
    assert not prefill_ws.supports(q, kc, kc)  # a CPU tensor
    if HOPPER:
        qg, kg = q.to(DEVICE), kc.to(DEVICE)
        assert prefill_ws.supports(qg, kg, kg)
        for d in (64, 256):
            qd = torch.empty(4, 8, d, dtype=torch.bfloat16, device=DEVICE)
            kd = torch.empty(3, 16, 2, d, dtype=torch.bfloat16, device=DEVICE)
            assert prefill_ws.supports(qd, kd, kd)
        assert not prefill_ws.supports(qg[..., :96], kg[..., :96], kg[..., :96])
        k8 = kg.to(torch.float8_e4m3fn)
        assert prefill_ws.supports(qg, k8, k8)
        assert not prefill_ws.supports(qg, k8, kg)
        assert not prefill_ws.supports(qg.half(), kg, kg)


def test_ws_flag_is_part_of_the_plan():
    case = WS_CASES[0]
    batch = ws_batch(case)
    ws = workspace(case[0], case[2])
    plan = ws_plan(batch, ws)
    assert plan.prefill is not None and plan.prefill.warp_specialized
    rule = plan_for(batch, ws)
    assert rule.prefill is not None
    assert dataclasses.replace(plan.prefill, warp_specialized=False) != plan.prefill


def _expected_prefill(num_seqs, hq, hkv, d, max_q, sms, kv_bytes):
    """(warp-specialized, block_m) the prefill rule should give, written out from its three
    parts: the 128-row tile up to one wave of the 256-row one (head size <= 128), else the
    Hopper kernel from its fill threshold (bf16 / fp8) on."""
    group = hq // hkv
    rows = attn.prefill_ws_tile(d)[0]
    programs = num_seqs * hkv * -(-max_q * group // rows)
    if rows > attn.PREFILL_WS_SMALL_ROWS >= group and programs <= sms:
        return True, attn.PREFILL_WS_SMALL_ROWS
    fill = attn.PREFILL_WS_MIN_FILL if kv_bytes == 2 else attn.PREFILL_WS_MIN_FILL_FP8
    return programs >= fill * sms, rows


@pytest.mark.parametrize("kv_bytes", [2, 1], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 16), (8, 1), (16, 8), (28, 4)])
def test_rule_takes_the_ws_prefill_kernel_at_its_head_sizes(hq, hkv, kv_bytes):
    """With the capability, prefill launches at head sizes 128 and 256 take the
    warp-specialized kernel: at 128 its 128-row tile while the 256-row one fills at most one
    wave of the SMs, beyond that the 256-row tile from PREFILL_WS_MIN_FILL (fp8:
    PREFILL_WS_MIN_FILL_FP8) x SMs programs on; at 256 its one tile from that threshold on;
    below it the Triton kernel; head size 64 as 128 with a 16-bit cache, the Triton kernel with
    an fp8 one; decode-only batches have no prefill launch."""
    sms = 132
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, sms=sms, workspace=None, kv_bytes=kv_bytes)
    sixteen_bit = attn.WS_PREFILL_RULE_HEAD_SIZES_16BIT if kv_bytes == 2 else ()
    for d in attn.WS_RULE_HEAD_SIZES + sixteen_bit:
        kw["head_size"] = d
        tile = attn.prefill_ws_tile(d)
        for num_seqs, max_q in ((2, 8192), (1, 512), (1, 1024), (1, 2048), (6, 9), (64, 300)):
            plan = attn.plan_launch(num_seqs=num_seqs, max_query_len=max_q,
                                    warp_specialized=True, **kw)  # fmt: skip
            got = plan.prefill
            assert got is not None
            ws, block_m = _expected_prefill(num_seqs, hq, hkv, d, max_q, sms, kv_bytes)
            assert got.warp_specialized == ws
            if got.warp_specialized:
                assert (got.block_m, got.block_n, got.num_warps, got.num_stages) == (
                    block_m,
                    *tile[1:],
                )
            else:
                triton = attn.plan_launch(num_seqs=num_seqs, max_query_len=max_q, **kw)
                assert got == triton.prefill
        decode = attn.plan_launch(num_seqs=8, max_query_len=1, warp_specialized=True, **kw)
        assert decode.prefill is None
        # Without the capability the rule is unchanged.
        plain = attn.plan_launch(num_seqs=2, max_query_len=8192, **kw)
        assert plain.prefill is not None and not plain.prefill.warp_specialized
        plans = attn.reachable_plans(warp_specialized=True, **kw)
        assert any(p.prefill is not None and p.prefill.warp_specialized for p in plans)
    d64 = attn.plan_launch(num_seqs=2, max_query_len=8192, warp_specialized=True,
                           **dict(kw, head_size=64))  # fmt: skip
    assert d64.prefill is not None and d64.prefill.warp_specialized == (kv_bytes == 2)


@pytest.mark.parametrize(
    "hq,hkv,d,kv_bytes,seq,expected",
    [
        # The sweeps' points on an H200 (132 SMs), each the fastest kernel measured there.
        (32, 8, 128, 2, 512, ("ws", 128)),  # Llama-3-8B: 17.1 µs, Triton 23.3
        (32, 8, 128, 2, 1024, ("ws", 128)),  # 33.6, 256-row tile 42.6
        (32, 8, 128, 2, 2048, ("ws", 256)),  # 86.3, 128-row tile 102.5
        (8, 1, 128, 2, 4096, ("ws", 128)),  # Llama-3-70B at TP 8: 88.8, 256-row 131.5
        (8, 1, 128, 2, 8192, ("ws", 256)),  # 272.8, 128-row 344.8
        (32, 8, 128, 1, 1024, ("ws", 128)),  # fp8: 44.7, Triton 52.5
        (32, 8, 128, 1, 4096, ("ws", 256)),  # fp8: 397.3, Triton 526.3
        (16, 8, 256, 1, 1024, ("triton", None)),  # Gemma-2-9B fp8: Triton 68.9, Hopper 72.9
        (16, 8, 256, 1, 2048, ("ws", 128)),  # 144.7, Triton 228.6
        (32, 8, 64, 2, 1024, ("ws", 128)),  # Llama-3.2-1B: 21.6, Triton 27.9
        (32, 8, 64, 2, 16384, ("ws", 256)),  # 2831, Triton 3155
        (32, 8, 64, 1, 4096, ("triton", None)),  # fp8: Triton 233.2, Hopper 253.5
        (16, 8, 256, 2, 512, ("triton", None)),  # bf16, 64 programs
        (16, 8, 256, 2, 1024, ("ws", 128)),  # 52.3, Triton 60.3
    ],
)
def test_prefill_rule_at_the_sweeps_points(hq, hkv, d, kv_bytes, seq, expected):
    plan = attn.plan_launch(num_seqs=1, num_q_heads=hq, num_kv_heads=hkv, head_size=d,
                            max_query_len=seq, sms=132, workspace=None, kv_bytes=kv_bytes,
                            warp_specialized=True).prefill  # fmt: skip
    kernel, rows = expected
    assert plan.warp_specialized == (kernel == "ws")
    if rows is not None:
        assert plan.block_m == rows


def test_cpu_calls_never_plan_the_ws_kernel(monkeypatch):
    """On the CPU (and any device `supports` refuses) `_run` plans the Triton kernels."""
    seen = []
    real = attn.plan_launch

    def spy(**kw):
        seen.append(kw["warp_specialized"])
        return real(**kw)

    monkeypatch.setattr(attn.run, "plan_launch", spy)
    case = WS_CASES[4]
    batch = ws_batch(case)
    run_case(batch, workspace=workspace(case[0], case[2]))
    assert seen == [HOPPER]


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

WS_DECODE_CASES = [
    # (Hq, Hkv, D, block, q dtype, seq_lens, layout, splits)
    (32, 8, 128, 16, torch.bfloat16, [5000], "nhd", 16),
    (32, 8, 128, 16, torch.bfloat16, [1, 16, 17, 64, 65, 2047], "nhd", 4),
    (16, 2, 128, 32, torch.float16, [700, 3], "hnd", 1),
    (8, 8, 64, 16, torch.bfloat16, [129, 4100], "nhd", 33),
    (16, 1, 64, 64, torch.float16, [1000], "nhd", 7),
]


def ws_decode_plan(batch: dict, ws, **changes) -> attn.LaunchPlan:
    dec = dict(tile_n=64, num_stages=4, head_fast=False)
    dec.update(changes, warp_specialized=True)
    return plan_for(batch, ws, **dec)


def ws_decode_batch(case, seed: int = 0) -> dict:
    Hq, Hkv, D, bs, q_dtype, seq_lens, layout, _ = case
    return make_batch(
        [1] * len(seq_lens), seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_size=D,
        block_size=bs, q_dtype=q_dtype, layout=layout, seed=seed or sum(seq_lens),
    )  # fmt: skip


@needs_hopper
@pytest.mark.parametrize("case", WS_DECODE_CASES, ids=lambda c: f"Hq{c[0]}-Hkv{c[1]}-D{c[2]}"
                         f"-bs{c[3]}-{str(c[4])[6:]}-n{len(c[5])}-s{c[7]}")  # fmt: skip
def test_ws_decode_matches_reference(case):
    batch = ws_decode_batch(case)
    ws = workspace(case[0], case[2], max_splits=64, rows=8)
    run_case(batch, workspace=ws, plan=ws_decode_plan(batch, ws, num_splits=case[7]))


@needs_hopper
@pytest.mark.parametrize(
    "changes",
    [dict(tile_n=128, num_stages=2), dict(num_stages=2), dict(num_stages=6), dict(head_fast=True)],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_ws_decode_configs(changes):
    case = WS_DECODE_CASES[1]
    batch = ws_decode_batch(case, seed=5)
    ws = workspace(case[0], case[2], max_splits=64, rows=8)
    run_case(batch, workspace=ws, plan=ws_decode_plan(batch, ws, num_splits=8, **changes))


@needs_hopper
def test_ws_decode_padding_request_and_repeats():
    """A padding request (no query) is skipped; 20 launches with 33 splits give bit-identical
    outputs and leave the split counters at zero (a race in the fused merge would show)."""
    case = WS_DECODE_CASES[0]
    Hq, Hkv, D, bs, q_dtype, _, layout, _ = case
    batch = make_batch([1, 0, 1], [3000, 0, 900], num_q_heads=Hq, num_kv_heads=Hkv, head_size=D,
                       block_size=bs, q_dtype=q_dtype, layout=layout, seed=9)  # fmt: skip
    ws = workspace(Hq, D, max_splits=64, rows=8)
    plan = ws_decode_plan(batch, ws, num_splits=33)
    assert_repeats_agree(batch, ws, plan)
    assert int(ws.counters.abs().sum()) == 0


# The options and caches beyond bf16/fp16 at head size 128: (Hq, Hkv, D, block, kv dtype,
# seq_lens, splits, options). Windows cut mid-tile, longer than the sequence, and with splits
# (some empty); sinks with and without splits (the merge adds them); soft cap at Gemma's 50.
FP8 = torch.float8_e4m3fn
WS_DECODE_OPTION_CASES = [
    (32, 8, 128, 16, FP8, [5000], 16, {}),
    (32, 8, 128, 16, FP8, [1, 17, 700, 2047], 1, {}),
    (8, 8, 64, 16, FP8, [129, 4100], 8, {}),
    (16, 8, 256, 16, FP8, [3000, 33], 5, {}),
    (16, 8, 256, 16, torch.bfloat16, [3000, 1, 64], 1, {}),
    (16, 8, 256, 32, torch.bfloat16, [4097], 16, {}),
    (32, 8, 128, 16, torch.bfloat16, [5000, 300, 1000], 8, dict(sliding_window=1000)),
    (32, 8, 128, 16, torch.bfloat16, [90, 5000], 1, dict(sliding_window=130)),
    (16, 8, 256, 16, torch.bfloat16, [2500, 40], 4, dict(softcap=50.0)),
    (32, 8, 128, 16, torch.bfloat16, [3000, 2], 1, dict(sinks=True)),
    (32, 8, 128, 16, torch.bfloat16, [3000, 2], 12, dict(sinks=True)),
    (16, 8, 256, 16, FP8, [4000, 50], 6, dict(sliding_window=777, softcap=30.0, sinks=True)),
]


@needs_hopper
@pytest.mark.parametrize(
    "case",
    WS_DECODE_OPTION_CASES,
    ids=lambda c: (
        f"Hq{c[0]}-Hkv{c[1]}-D{c[2]}-{str(c[4])[6:]}-n{len(c[5])}-s{c[6]}-" + ",".join(sorted(c[7]))
    ),
)
def test_ws_decode_options_and_caches_match_reference(case):
    """fp8 caches (staged through registers), head sizes 64 / 256, sliding window, soft cap and
    sinks in the warp-specialized decode kernel, at its rule's tile for the cache, with and
    without splits; outputs against the reference, then repeated launches bit-identical."""
    Hq, Hkv, D, bs, kv_dtype, seq_lens, splits, options = case
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_size=D,
        block_size=bs, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, seed=sum(seq_lens) + D,
    )  # fmt: skip
    options = dict(options)
    if options.pop("sinks", False):
        gen = torch.Generator().manual_seed(D)
        options["sinks"] = (torch.randn(Hq, generator=gen) * 2.0).to(DEVICE)
    ws = workspace(Hq, D, max_splits=64, rows=8)
    tile_n, slots = attn.decode_ws_tile(D, kv_dtype.itemsize)
    plan = ws_decode_plan(batch, ws, num_splits=splits, tile_n=tile_n, num_stages=slots)
    assert_repeats_agree(batch, ws, plan, times=5, **options)


def test_ws_decode_supports_its_caches_and_options():
    """`decode_ws.supports`: fp8 and q-dtype caches at head sizes 64 / 128 / 256 on sm_90 (any
    option: the options are not its to refuse); CPU tensors, other head sizes, mixed dtypes
    never."""
    from fuselane.kernels.attention import decode_ws

    q = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    kc = torch.empty(3, 16, 2, 128, dtype=torch.bfloat16)
    assert not decode_ws.supports(q, kc, kc)
    if HOPPER:
        for d in (64, 128, 256):
            qg = torch.empty(4, 8, d, dtype=torch.bfloat16, device=DEVICE)
            kg = torch.empty(3, 16, 2, d, dtype=torch.bfloat16, device=DEVICE)
            assert decode_ws.supports(qg, kg, kg)
            assert decode_ws.supports(qg, kg.to(FP8), kg.to(FP8))
        qg, kg = q.to(DEVICE), kc.to(DEVICE)
        assert not decode_ws.supports(qg[..., :96], kg[..., :96], kg[..., :96])
        assert not decode_ws.supports(qg.half(), kg, kg)
        assert not decode_ws.supports(qg, kg, kg.to(FP8))


def test_ws_decode_plan_refused_for_a_mixed_batch():
    """The decode kernel's plan on a batch with prefill rows (or anywhere `supports` refuses,
    e.g. the CPU) raises, naming what it runs."""
    case = WS_CASES[5]
    batch = ws_batch(case)
    ws = workspace(case[0], case[2])
    plan = plan_for(batch, ws, warp_specialized=True)
    with pytest.raises(ValueError, match="warp-specialized decode kernel runs decode-only"):
        run_case(batch, workspace=ws, plan=plan)


def test_rule_takes_the_ws_decode_kernel_for_one_decode_sequence():
    """A decode-only batch of one sequence, one program per SM; two or more sequences take the
    Triton kernel's balanced split (its pieces follow the lengths)."""
    ws = attn.AttentionWorkspace.allocate(256, 32, 128, torch.device("cpu"), max_splits=64)
    kw = dict(num_q_heads=32, num_kv_heads=8, head_size=128, sms=132, workspace=ws)
    splits = {}
    for b in range(1, 9):
        dec = attn.plan_launch(num_seqs=b, max_query_len=1, warp_specialized=True, **kw).decode
        if dec.warp_specialized:
            assert (dec.tile_n, dec.num_stages) == attn.DECODE_WS_TILE
            assert dec.num_splits * b * 8 <= 132
            splits[b] = dec.num_splits
    assert splits == {1: 16}
    for b in (2, 4, 8):
        dec = attn.plan_launch(num_seqs=b, max_query_len=1, warp_specialized=True, **kw).decode
        assert dec.split_budget >= 32, (b, dec)  # one wave of 264 programs or more
    # One kv head (Llama-3-70B at tensor parallel 8): splits of 132 // B would suit the decode
    # kernel from B = 9 on; the balanced split takes those batches too.
    one = dict(kw, num_q_heads=8, num_kv_heads=1)
    for b in (9, 16, 33):
        dec = attn.plan_launch(num_seqs=b, max_query_len=1, warp_specialized=True, **one).decode
        assert not dec.warp_specialized and dec.split_budget >= 128, (b, dec)
        assert attn.decode_ws_config(b, 8, 1, 128, 132, ws, 2) is not None  # it would suit
    # Not taken: spec-verify rows, no workspace, head sizes it was not timed at, no capability.
    for changes in (
        dict(max_query_len=2),
        dict(workspace=None),
        dict(head_size=64),
        dict(warp_specialized=False),
    ):
        args = dict(kw, num_seqs=1, max_query_len=1, warp_specialized=True)
        assert not attn.plan_launch(**{**args, **changes}).decode.warp_specialized, changes
    small = attn.AttentionWorkspace.allocate(1, 32, 128, torch.device("cpu"), max_splits=2)
    args = dict(kw, num_seqs=1, max_query_len=1, warp_specialized=True, workspace=small)
    assert not attn.plan_launch(**args).decode.warp_specialized  # room for 2 splits only


def test_without_gluon_the_triton_kernels_run(monkeypatch):
    """A Triton without Gluon's Hopper API (the import failed): nothing plans the
    warp-specialized kernels, and a plan that names one is refused with the reason."""
    monkeypatch.setattr(attn.hopper, "prefill_ws", None)
    monkeypatch.setattr(attn.hopper, "decode_ws", None)
    monkeypatch.setattr(attn.hopper, "_hopper_off", "triton 3.x has no Gluon Hopper API")
    case = WS_CASES[4]
    batch = ws_batch(case)
    args = {k: batch[k] for k in ("q", "key_cache", "value_cache")}
    assert not attn.warp_specialized_ok(**args)
    ws = workspace(case[0], case[2])
    run_case(batch, workspace=ws)  # the rule's plan: Triton kernels
    with pytest.raises(ValueError, match="warp-specialized prefill kernel runs sm_90"):
        run_case(batch, workspace=ws, plan=ws_plan(batch, ws))


def test_the_operator_switch_keeps_the_triton_kernels(monkeypatch):
    """FUSELANE_HOPPER_KERNELS=0 (the plugin then calls `disable_hopper_kernels`): the rule
    plans the Triton kernels for a batch the Hopper kernels would take, their results match
    the reference, and a plan naming a Hopper kernel is refused with the switch named."""
    # Small (the interpreter runs it on the CPU); the Hopper kernels take it on an sm_90 GPU.
    case = (4, 2, 64, 16, torch.bfloat16, [33, 1], [40, 17], "nhd")
    batch = ws_batch(case)
    args = {k: batch[k] for k in ("q", "key_cache", "value_cache")}
    assert attn.warp_specialized_ok(**args) is HOPPER  # on where they apply
    monkeypatch.setattr(attn.hopper, "_hopper_off", attn.hopper_kernels_off())  # undone after
    attn.disable_hopper_kernels("FUSELANE_HOPPER_KERNELS=0")
    assert not attn.warp_specialized_ok(**args)
    ws = workspace(case[0], case[2])
    run_case(batch, workspace=ws)  # the rule's plan: Triton kernels, checked against the reference
    with pytest.raises(ValueError, match=r"off in this process: FUSELANE_HOPPER_KERNELS=0"):
        run_case(batch, workspace=ws, plan=ws_plan(batch, ws))


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_launchers_bind_every_kernel_argument(monkeypatch, which):
    """The launchers' argument lists against the kernels' signatures (runs on the CPU, where the
    kernels themselves cannot): every parameter bound once, strides and shapes where they
    belong."""
    from fuselane.kernels.attention import decode_ws

    module = prefill_ws if which == "prefill" else decode_ws
    calls = []
    monkeypatch.setattr(module, "launch", lambda fn, grid, *a, **kw: calls.append((fn, a, kw)))
    if which == "prefill":
        batch = ws_batch(WS_CASES[2])
        b = batch
        prefill_ws.launch_prefill_ws(
            b["q"], b["key_cache"], b["value_cache"], nan_out(b["q"]), paged_batch(b),
            attn.AttentionOptions(scale=0.1),
            attn.PrefillConfig(block_m=256, block_n=64, min_q=8, num_warps=4, num_stages=4,
                               head_fast=True, warp_specialized=True),
        )  # fmt: skip
    else:
        batch = ws_decode_batch(WS_DECODE_CASES[2])
        b = batch
        ws = workspace(16, 128, max_splits=8, rows=8)
        decode_ws.launch_decode_ws(
            b["q"], b["key_cache"], b["value_cache"], nan_out(b["q"]), paged_batch(b),
            attn.AttentionOptions(scale=0.1), ws,
            attn.DecodeConfig(qpos=1, block_m=16, tile_n=128, num_splits=4, max_q=1,
                              num_warps=4, num_stages=2, warp_specialized=True),
        )  # fmt: skip
    ((fn, args, kwargs),) = calls
    assert kwargs.pop("num_warps") == 4  # a launch option, not a kernel parameter
    names = fn.arg_names
    bound = dict(zip(names, args, strict=False))
    assert len(args) + len(kwargs) == len(names)
    assert not set(bound) & set(kwargs)
    bound.update(kwargs)
    kc, vc, q = batch["key_cache"], batch["value_cache"], batch["q"]
    assert (bound["stride_kb"], bound["stride_ks"], bound["stride_kh"]) == kc.stride()[:3]
    assert (bound["stride_vb"], bound["stride_vs"], bound["stride_vh"]) == vc.stride()[:3]
    assert (bound["stride_qt"], bound["stride_qh"]) == q.stride()[:2]
    assert bound["stride_bt"] == batch["block_table"].stride(0)
    assert bound["PAGE"] == kc.shape[1] and bound["HEAD"] == q.shape[2]
    assert bound["k_ptr"] is kc and bound["v_ptr"] is vc and bound["q_ptr"] is q


@pytest.mark.parametrize("strict", [False, True])
def test_a_hopper_kernel_failing_at_warm_up_is_switched_off(monkeypatch, strict):
    """Start-up: a Hopper kernel that fails to compile or launch is switched off for the process
    and the warm-up goes on with the Triton kernels; with strict (CUSTOM named), it stops."""
    launched = []

    def run(*args, plan, **kwargs):
        if attn.run._uses_hopper_kernels(plan):
            raise AttributeError("module 'gluon.language' has no attribute 'thread_barrier'")
        launched.append(plan)

    monkeypatch.setattr(attn.run, "_run", run)
    for name in ("warp_specialized_ok", "decode_warp_specialized_ok"):
        monkeypatch.setattr(attn.run, name, lambda *a, **k: attn.hopper_kernels_off() is None)
    monkeypatch.setattr(attn.hopper, "_hopper_off", None)
    monkeypatch.setattr(attn.run, "sm_count", lambda device: 132)
    batch = ws_batch(WS_CASES[0])
    ws = workspace(WS_CASES[0][0], WS_CASES[0][2])
    args = (batch["key_cache"], batch["value_cache"], batch["block_table"][:1])
    kw = dict(
        num_q_heads=batch["q"].shape[1],
        q_dtype=batch["q"].dtype,
        options=attn.AttentionOptions(scale=0.1),
        workspace=ws,
    )
    if strict:
        with pytest.raises(AttributeError, match="thread_barrier"):
            attn.warm_up(*args, **kw, strict=True)
        assert attn.hopper_kernels_off() is None
        return
    n = attn.warm_up(*args, **kw)
    assert "AttributeError at start-up" in attn.hopper_kernels_off()
    assert n == len(launched) > 0
    assert not any(attn.run._uses_hopper_kernels(p) for p in launched)
    full = attn.reachable_plans(
        num_q_heads=kw["num_q_heads"], num_kv_heads=batch["key_cache"].shape[2],
        head_size=batch["q"].shape[2], sms=132, workspace=ws, warp_specialized=True,
    )  # fmt: skip
    assert any(attn.run._uses_hopper_kernels(p) for p in full)  # the rule would have taken them

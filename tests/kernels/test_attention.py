"""kernels/attention/: paged attention against its fp32 torch reference.

Runs under Triton's interpreter on the CPU, and on the GPU as it is (`tests.device.DEVICE`):
inputs are drawn on the CPU from seeded generators and moved to DEVICE, so both see the same
numbers, and on a GPU the compiled kernels are what is tested (the fused split merge's atomics
included); no test here depends on the interpreter. Every batch is built the way vLLM hands it
over: caches that are strided views of one KV tensor (K and V interleaved per head, or
head-major), a random page permutation, block 0 as the null block that unused block-table
entries point at, queries as views of a fused QKV output. Everything the kernel must not read
is NaN: the null block, spare blocks, and the slots past seq_len in each sequence's last page.
`out` is NaN before every call, and its rows past cu_seqlens_q[-1] (CUDA-graph padding) must
still be NaN after it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fuselane.kernels import _launch
from fuselane.kernels import attention as attn
from fuselane.kernels._checks import FP8_E4M3
from fuselane.kernels.attention import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    AttentionWorkspace,
    paged_attention,
    paged_attention_reference,
)
from fuselane.kernels.attention import decode as attention_decode
from fuselane.kernels.attention import prefill as attention_prefill
from tests.allclose import assert_close
from tests.device import DEVICE

FP8_NAN_BYTE = 0x7F
PAD_ROWS = 3  # rows of q / out past cu_seqlens_q[-1]
# (q dtype, atol, rtol) against the fp32 reference. The kernel rounds the softmax weights to the
# q dtype before P @ V (as every flash kernel does) and the output once; Triton's interpreter
# also rounds fp32 -> bf16 toward zero. Largest errors measured over these cases: fp16 0.002,
# bf16 0.016 (one bf16 ulp at |out| ~ 2).
ATTN_TOLERANCES = [
    (torch.float16, 4e-3, 4e-3),
    (torch.bfloat16, 2.5e-2, 2.5e-2),
    # fp32 (the CPU engine's dtype): ieee fp32 products, summation order differs only.
    (torch.float32, 1e-5, 1e-5),
]
TOL = {dt: (atol, rtol) for dt, atol, rtol in ATTN_TOLERANCES}
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    layout: str = "nhd",
    seed: int = 0,
) -> dict:
    """Inputs of one call (keys named as paged_attention's arguments) plus `num_rows`.

    Drawn on the CPU from a seeded generator, then moved to DEVICE (views taken there)."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or q_dtype
    assert all(s >= q for q, s in zip(q_lens, seq_lens, strict=True))
    pages = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(pages) + 2  # block 0: null block; 2 spare blocks
    H, D = num_kv_heads, head_size
    if layout == "nhd":  # vLLM's default: physical [blocks, slots, heads, K|V]
        base = torch.randn(num_blocks, block_size, H, 2 * D, generator=gen)
    elif layout == "hnd":  # physical [blocks, heads, slots, K|V]: head stride > slot stride
        base = torch.randn(num_blocks, H, block_size, 2 * D, generator=gen)
    else:
        raise AssertionError(layout)
    # Unreadable data: null block, spare blocks, slots past each sequence's end.
    poison = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    poison[0] = True
    poison[-2:] = True
    order = (torch.randperm(num_blocks - 3, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(pages, default=0) + 2, dtype=torch.int32)
    next_page = 0
    for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens, strict=True)):
        phys = order[next_page : next_page + n_pages]
        next_page += n_pages
        block_table[b, :n_pages] = torch.tensor(phys, dtype=torch.int32)
        if n_pages:
            tail = seq_len - (n_pages - 1) * block_size
            poison[phys[-1], tail:] = True
    if kv_dtype == FP8_E4M3:
        base = (base * 2.0).to(FP8_E4M3)  # e4m3 codes spread over [-8, 8]
        base.view(torch.uint8).masked_fill_(poison_mask(poison, layout, base.shape), FP8_NAN_BYTE)
    else:
        base = base.to(kv_dtype)
        base.masked_fill_(poison_mask(poison, layout, base.shape), float("nan"))
    base = base.to(DEVICE)
    if layout == "nhd":
        key_cache, value_cache = base.split(D, dim=-1)
    else:
        key_cache, value_cache = base.transpose(1, 2).split(D, dim=-1)

    num_rows = sum(q_lens)
    # q: a view of a fused QKV projection output (row stride (Hq + 2 Hkv) * D)
    qkv = torch.randn(num_rows + PAD_ROWS, (num_q_heads + 2 * H) * D, generator=gen)
    qkv = qkv.to(DEVICE, q_dtype)
    q = qkv[:, : num_q_heads * D].view(num_rows + PAD_ROWS, num_q_heads, D)
    cu = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    args = dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        cu_seqlens_q=cu.to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        scale=1.0 / math.sqrt(D),
    )
    if kv_dtype == FP8_E4M3:
        args["k_scale"] = torch.tensor([0.37], dtype=torch.float32, device=DEVICE)
        args["v_scale"] = torch.tensor([0.61], dtype=torch.float32, device=DEVICE)
    args["num_rows"] = num_rows
    return args


def poison_mask(poison: torch.Tensor, layout: str, shape: torch.Size) -> torch.Tensor:
    """[blocks, slots] poison flags broadcast onto the physical base tensor."""
    if layout == "nhd":
        return poison[:, :, None, None].expand(shape)
    return poison[:, None, :, None].expand(shape)


def nan_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def run_case(batch: dict, *, workspace=None, plan=None, **options) -> torch.Tensor:
    """Kernel vs reference on `batch`; returns the kernel's output.

    plan: a `LaunchPlan` to launch instead of the rule's (through `attention.run._run`, as the
    benchmark's sweeps do). With a workspace, its split counters must be back at zero after.
    """
    batch = dict(batch)
    num_rows = batch.pop("num_rows")
    q = batch["q"]
    out = nan_out(q)
    if plan is None:
        result = paged_attention(out=out, **batch, workspace=workspace, **options)
        assert result is out
    else:
        attn.run._run(
            q, batch["key_cache"], batch["value_cache"], out, paged_batch(batch),
            attention_options(batch, **options), workspace, plan=plan,
        )  # fmt: skip
    assert_matches_reference(batch, out, num_rows, **options)
    assert torch.isnan(out[num_rows:]).all(), "rows past cu_seqlens_q[-1] were written"
    if workspace is not None:
        assert int(workspace.counters.abs().sum()) == 0, "split counters not reset"
    return out


def assert_matches_reference(batch: dict, out: torch.Tensor, rows: int | None = None,
                             **options) -> None:  # fmt: skip
    """`out`'s first `rows` rows (default: the batch's `num_rows`) against the reference on
    `batch` (a `make_batch` dict, its metadata as it is now), at the q dtype's tolerance."""
    args = {k: v for k, v in batch.items() if k != "num_rows"}
    rows = batch["num_rows"] if rows is None else rows
    expected = nan_out(args["q"])
    paged_attention_reference(out=expected, **args, **options)
    atol, rtol = TOL[args["q"].dtype]
    assert_close(out[:rows], expected[:rows], atol=atol, rtol=rtol, what="attention")


def attention_options(batch: dict, **options) -> attn.AttentionOptions:
    """The `AttentionOptions` of a `make_batch` dict with `paged_attention`'s option keywords."""
    return attn.AttentionOptions(
        batch["scale"], options.get("sliding_window"), options.get("softcap", 0.0),
        options.get("sinks"), batch.get("k_scale"), batch.get("v_scale"),
    )  # fmt: skip


def paged_batch(batch: dict) -> attn.PagedBatch:
    """The `PagedBatch` of a `make_batch` dict."""
    return attn.PagedBatch(
        batch["cu_seqlens_q"], batch["seq_lens"], batch["block_table"], batch["max_query_len"]
    )


def workspace(num_q_heads: int, head_size: int, max_splits: int = 4, rows: int = 32):
    return AttentionWorkspace.allocate(rows, num_q_heads, head_size, DEVICE, max_splits=max_splits)


def plan_for(batch: dict, ws, **changes) -> attn.LaunchPlan:
    """The rule's plan for `batch`, with `changes` applied to its decode config and
    `prefill_changes` (a dict, in changes) to its prefill config."""
    q, kc = batch["q"], batch["key_cache"]
    prefill_changes = changes.pop("prefill_changes", {})
    plan = attn.plan_launch(
        num_seqs=batch["seq_lens"].shape[0], num_q_heads=q.shape[1], num_kv_heads=kc.shape[2],
        head_size=q.shape[2], max_query_len=batch["max_query_len"], sms=attn.sm_count(CPU),
        workspace=ws, kv_bytes=kc.element_size(),
    )  # fmt: skip
    prefill = plan.prefill
    if prefill is not None and prefill_changes:
        prefill = dataclasses.replace(prefill, **prefill_changes)
    return attn.LaunchPlan(decode=dataclasses.replace(plan.decode, **changes), prefill=prefill)


# ----------------------------------------------------------------------------------------------
# Decode (query_len 1)
# ----------------------------------------------------------------------------------------------

# Every head size and block size, GQA groups 1/2/4/5/8, both q dtypes, fp8 KV; contexts of one
# token, exact page multiples, one past a page, and long ones over many pages.
DECODE_CASES = [
    # (Hq, Hkv, D, block, q dtype, kv dtype, seq_lens, max_splits)
    (4, 1, 64, 16, torch.bfloat16, None, [1, 16, 17, 100], 4),
    (8, 1, 80, 32, torch.float16, None, [33, 64, 65, 700], 3),
    (6, 3, 96, 64, torch.bfloat16, None, [2, 64, 129, 300], 2),
    (5, 1, 128, 16, torch.float16, None, [1, 31, 32, 1999], 4),
    (2, 2, 256, 32, torch.bfloat16, None, [1, 63, 97, 200], 4),
    (4, 4, 128, 64, torch.float16, None, [5, 128, 1000], 1),
    (4, 2, 128, 16, torch.bfloat16, FP8_E4M3, [1, 47, 300], 4),
    (6, 3, 80, 32, torch.float16, FP8_E4M3, [3, 32, 33, 250], 2),
]


def test_fp8_cache_with_queries_beyond_fp16_range():
    """An fp8 cache meets a bf16 q in fp16 (decode._fp8_query): q is scaled on the way, so query
    values past fp16's largest (65504) stay finite; decode and prefill rows, checked against
    the reference."""
    batch = make_batch(
        [1, 40], [300, 90], num_q_heads=4, num_kv_heads=2, head_size=128, block_size=16,
        q_dtype=torch.bfloat16, kv_dtype=FP8_E4M3, seed=11,
    )  # fmt: skip
    batch["q"] = batch["q"] * 2.0e5
    assert batch["q"].abs().max() > 65504
    batch["scale"] = batch["scale"] / 2.0e5  # logits of the usual size
    run_case(batch, workspace=workspace(4, 128))


@pytest.mark.parametrize(
    "case",
    DECODE_CASES,
    ids=lambda c: (
        f"Hq{c[0]}-Hkv{c[1]}-D{c[2]}-bs{c[3]}-{str(c[4])[6:]}-"
        f"{'fp8' if c[5] else 'same'}-splits{c[7]}"
    ),
)
def test_decode_matches_reference(case):
    Hq, Hkv, D, bs, q_dtype, kv_dtype, seq_lens, max_splits = case
    batch = make_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_size=D,
        block_size=bs,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        layout=("nhd", "hnd")[D % 3 == 0],
        seed=D + bs,
    )
    ws = workspace(Hq, D, max_splits) if max_splits > 1 else None
    run_case(batch, workspace=ws)


def test_decode_without_workspace_runs_unsplit():
    batch = make_batch(
        [1, 1], [40, 300], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    run_case(batch, workspace=None)


def test_split_kv_with_many_empty_splits():
    """64 splits over a 1-token, a 70-token and a 1000-token context: most splits of the short
    sequences own no tile and must write a neutral partial the reduction ignores."""
    batch = make_batch(
        [1, 1, 1], [1, 70, 1000], num_q_heads=4, num_kv_heads=1, head_size=64, block_size=16, seed=3
    )
    ws = workspace(4, 64, max_splits=64, rows=3)
    plan = attn.plan_launch(
        num_seqs=3, num_q_heads=4, num_kv_heads=1, head_size=64, max_query_len=1,
        sms=attn.sm_count(CPU), workspace=ws,
    )  # fmt: skip
    assert plan.decode.num_splits == 64
    run_case(batch, workspace=ws)


def test_small_workspace_reduces_splits():
    ws = workspace(4, 64, max_splits=8, rows=2)  # room for 2 rows x 8 splits
    plan = attn.plan_launch(
        num_seqs=4, num_q_heads=4, num_kv_heads=1, head_size=64, max_query_len=1, sms=132,
        workspace=ws,
    )  # fmt: skip
    assert plan.decode.num_splits == 4
    batch = make_batch([1] * 4, [5, 90, 200, 33], num_q_heads=4, num_kv_heads=1, head_size=64,
                       block_size=16, seed=4)  # fmt: skip
    run_case(batch, workspace=ws)


def test_padding_requests_with_empty_query():
    """CUDA-graph padding: requests with query_len 0 (and seq_len 0) write nothing."""
    batch = make_batch([1, 0, 1, 0], [50, 0, 7, 0], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=5)  # fmt: skip
    run_case(batch, workspace=workspace(4, 64))


# ----------------------------------------------------------------------------------------------
# Prefill, speculative verify, mixed batches
# ----------------------------------------------------------------------------------------------

MIXED_CASES = [
    # (Hq, Hkv, D, block, q dtype, kv dtype, q_lens, seq_lens)
    # pure prefill, query_len == seq_len (no cache prefix), page-crossing lengths
    (4, 1, 128, 16, torch.bfloat16, None, [130, 17, 1], [130, 17, 1]),
    (6, 3, 96, 32, torch.float16, None, [200, 9], [200, 9]),
    # chunked prefill after a cached prefix
    (8, 1, 64, 64, torch.bfloat16, None, [100, 40], [612, 41]),
    (5, 1, 80, 16, torch.float16, None, [33, 10], [1033, 10]),
    (2, 2, 256, 32, torch.bfloat16, None, [70, 12], [170, 300]),
    # mixed: decode rows, verify rows of 2-8, prefill chunks in one call
    (4, 2, 128, 16, torch.bfloat16, None, [1, 3, 64, 1, 8, 20], [500, 77, 64, 1, 1900, 300]),
    (8, 2, 64, 32, torch.float16, None, [2, 1, 150, 5, 1], [40, 1, 150, 1000, 17]),
    (4, 2, 128, 16, torch.bfloat16, FP8_E4M3, [1, 4, 90, 1], [300, 50, 190, 1]),
    (6, 3, 80, 64, torch.float16, FP8_E4M3, [40, 1, 7], [40, 600, 7]),
    (4, 2, 64, 32, torch.float32, None, [1, 6, 70, 1], [33, 6, 200, 900]),
]


@pytest.mark.parametrize(
    "case",
    MIXED_CASES,
    ids=lambda c: (
        f"Hq{c[0]}-Hkv{c[1]}-D{c[2]}-bs{c[3]}-{str(c[4])[6:]}-"
        f"{'fp8' if c[5] else 'same'}-q{'_'.join(map(str, c[6]))}"
    ),
)
def test_prefill_and_mixed_match_reference(case):
    Hq, Hkv, D, bs, q_dtype, kv_dtype, q_lens, seq_lens = case
    batch = make_batch(
        q_lens,
        seq_lens,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_size=D,
        block_size=bs,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        layout=("nhd", "hnd")[bs == 32],
        seed=sum(q_lens),
    )
    run_case(batch, workspace=workspace(Hq, D))


@pytest.mark.parametrize("q_lens", [[2, 5, 8], [3, 1, 4, 2]])
def test_speculative_verify_batch(q_lens):
    """max_query_len <= 8: only the decode kernel runs, in the tile of the position cap (8
    positions of the GQA group), whatever the longest query."""
    seq_lens = [q + c for q, c in zip(q_lens, [30, 250, 17, 64], strict=False)]
    batch = make_batch(q_lens, seq_lens, num_q_heads=8, num_kv_heads=2, head_size=64,
                       block_size=16, seed=len(q_lens))  # fmt: skip
    plan = attn.plan_launch(
        num_seqs=len(q_lens), num_q_heads=8, num_kv_heads=2, head_size=64,
        max_query_len=max(q_lens), sms=132, workspace=workspace(8, 64),
    )  # fmt: skip
    assert plan.prefill is None and plan.decode.qpos == attn.DECODE_MAX_QUERY_LEN
    run_case(batch, workspace=workspace(8, 64, rows=32))


def test_stale_max_query_len_is_still_exact():
    """A graph captured as a decode batch (max_query_len=1) replayed with longer queries: the
    decode kernel walks the extra positions in chunks, the result stays exact."""
    batch = make_batch([1, 3, 20], [90, 40, 20], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=6)  # fmt: skip
    batch["max_query_len"] = 1
    run_case(batch, workspace=workspace(4, 64))


# ----------------------------------------------------------------------------------------------
# Sliding window, soft cap, sinks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window,q_lens,seq_lens",
    [
        (1, [1, 5, 40], [30, 5, 300]),  # each query sees itself only
        (16, [1, 1, 70], [17, 500, 200]),  # page-aligned window
        (50, [1, 3, 130], [1, 300, 400]),  # window longer than a context, shorter than others
        (100, [2, 64], [1000, 64]),  # window > query_len: prefill tile crosses the window edge
    ],
)
def test_sliding_window(window, q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=window)  # fmt: skip
    run_case(batch, workspace=workspace(4, 64), sliding_window=window)


def test_sliding_window_vllm_convention():
    """W keys per query including itself: with W=2 a decode row averages its last two values."""
    batch = make_batch([1], [9], num_q_heads=1, num_kv_heads=1, head_size=64, block_size=16)
    batch.pop("num_rows")
    q = batch["q"]
    q.zero_()  # equal logits: the output is the plain mean of the visible values
    out = nan_out(q)
    paged_attention(out=out, **batch, sliding_window=2)
    page = int(batch["block_table"][0, 0])
    v = batch["value_cache"][page, 7:9, 0].float()
    assert_close(out[0, 0].float(), v.mean(0), atol=1e-2, rtol=1e-2, what="window of 2")


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1], [60, 900]), ([1, 6, 50], [3, 80, 120])])
def test_softcap(q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, num_q_heads=4, num_kv_heads=1, head_size=128,
                       block_size=32, seed=7)  # fmt: skip
    batch["scale"] = 1.0  # large logits, so the cap changes the result
    run_case(batch, workspace=workspace(4, 128), softcap=5.0)


@pytest.mark.parametrize(
    "q_lens,seq_lens,max_splits",
    [([1, 1], [60, 900], 4), ([1, 1], [60, 900], 1), ([1, 6, 50], [3, 80, 120], 4)],
)
def test_sinks(q_lens, seq_lens, max_splits):
    """Sinks join the denominator once: in the kernel (unsplit) or in the reduction (split)."""
    batch = make_batch(q_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=8)  # fmt: skip
    sinks = torch.tensor([-1.0, 0.5, 3.0, 8.0], device=DEVICE)  # from negligible to dominant
    ws = workspace(4, 64, max_splits) if max_splits > 1 else None
    run_case(batch, workspace=ws, sinks=sinks)


def test_all_options_together():
    batch = make_batch([1, 4, 60], [700, 30, 200], num_q_heads=6, num_kv_heads=2, head_size=96,
                       block_size=32, kv_dtype=FP8_E4M3, q_dtype=torch.float16, seed=9)  # fmt: skip
    run_case(batch, workspace=workspace(6, 96), sliding_window=64, softcap=20.0,
             sinks=torch.linspace(-2.0, 2.0, 6, device=DEVICE))  # fmt: skip


def test_unchecked_entry_point_matches_checked():
    """vLLM's backend calls `paged_attention_unchecked` after a layer's first (checked) call:
    same launches, same output bit for bit, on a mixed batch with every option."""
    batch = make_batch([1, 5, 70], [400, 40, 300], num_q_heads=6, num_kv_heads=2, head_size=64,
                       block_size=16, seed=31)  # fmt: skip
    num_rows = batch.pop("num_rows")
    options = dict(sliding_window=100, softcap=15.0,
                   sinks=torch.linspace(-1.0, 1.0, 6, device=DEVICE))  # fmt: skip
    ws = workspace(6, 64)
    checked = paged_attention(out=nan_out(batch["q"]), **batch, workspace=ws, **options)
    unchecked = attn.paged_attention_unchecked(
        out=nan_out(batch["q"]), **batch, workspace=ws, **options
    )
    assert torch.equal(unchecked[:num_rows], checked[:num_rows])
    assert not torch.isnan(unchecked[:num_rows]).any()
    assert torch.isnan(unchecked[num_rows:]).all()


# ----------------------------------------------------------------------------------------------
# CUDA-graph invariance: the launches depend on shapes only
# ----------------------------------------------------------------------------------------------


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records grid and constexprs, then launches."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.kernel.fn.__name__, tuple(grid), sorted(kwargs.items())))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launch_log(monkeypatch):
    log: list = []
    # Compiled launches go through `fn[grid]` (the recorder), not straight to a kernel compiled
    # earlier in the process.
    monkeypatch.setattr(_launch, "DIRECT", False)
    for module, name in [
        (attention_decode, "_decode_kernel"),
        (attention_decode, "_splitkv_reduce_kernel"),
        (attention_prefill, "_prefill_kernel"),
    ]:
        monkeypatch.setattr(module, name, LaunchRecorder(getattr(module, name), log))
    return log


@pytest.mark.parametrize(
    "q_lens,lens_a,lens_b",
    [
        ([1, 1, 1], [1, 30, 200], [700, 2, 64]),  # decode, split
        ([1, 4, 40], [10, 70, 40], [300, 4, 900]),  # mixed
    ],
)
def test_launches_depend_only_on_shapes(launch_log, q_lens, lens_a, lens_b):
    """Same batch shape, different sequence lengths (and max_seq_len): identical launches,
    both exact — what replaying one captured CUDA graph with new lengths requires."""
    ws = workspace(4, 64, max_splits=4)
    logs = []
    for seed, lens in enumerate((lens_a, lens_b)):
        batch = make_batch(q_lens, lens, num_q_heads=4, num_kv_heads=2, head_size=64,
                           block_size=16, seed=seed)  # fmt: skip
        run_case(batch, workspace=ws)
        logs.append(list(launch_log))
        launch_log.clear()
    assert logs[0] == logs[1]
    names = [entry[0] for entry in logs[0]]
    decode = dict(logs[0][names.index("_decode_kernel")][2])
    assert decode["SPLIT"] and decode["FUSED_REDUCE"]  # the split path, merged in the kernel
    assert "_splitkv_reduce_kernel" not in names  # one launch for decode, split or not
    assert ("_prefill_kernel" in names) == (max(q_lens) > attn.DECODE_MAX_QUERY_LEN)


def test_prefill_only_batch_skips_decode_launch(launch_log):
    """With the host's shortest query longer than the decode kernel's positions, the decode
    launch (whose programs would all return at once) is left out; the output is the same to
    the bit. Padding requests (no query) do not count; a query of exactly the cap is the
    decode kernel's row, so its launch stays."""
    ws = workspace(4, 64)
    batch = make_batch([40, 0, 17], [100, 0, 17], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=11)  # fmt: skip
    cap = plan_for(batch, ws).prefill.min_q
    skipped = run_case(batch, workspace=ws, min_query_len=17)
    assert [entry[0] for entry in launch_log] == ["_prefill_kernel"]
    launch_log.clear()
    both = run_case(batch, workspace=ws)  # min_query_len unknown (0): both launches
    assert [entry[0] for entry in launch_log] == ["_decode_kernel", "_prefill_kernel"]
    assert torch.equal(skipped[: batch["num_rows"]], both[: batch["num_rows"]])
    launch_log.clear()
    at_cap = make_batch([cap, 40], [cap + 30, 60], num_q_heads=4, num_kv_heads=2,
                        head_size=64, block_size=16, seed=12)  # fmt: skip
    run_case(at_cap, workspace=ws, min_query_len=cap)
    assert [entry[0] for entry in launch_log] == ["_decode_kernel", "_prefill_kernel"]


def test_decode_launch_kept_while_a_cuda_graph_is_captured(monkeypatch):
    """A captured graph is replayed with other batches, decode rows included: no skip then."""
    plan = attn.plan_launch(num_seqs=2, num_q_heads=4, num_kv_heads=2, head_size=64,
                            max_query_len=40, sms=132, workspace=None)  # fmt: skip
    on_gpu = dataclasses.make_dataclass("T", ["device"])(torch.device("cuda", 0))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert attn.run._skips_decode(plan, 17, on_gpu)
    capturing[0] = True
    assert not attn.run._skips_decode(plan, 17, on_gpu)
    assert not attn.run._skips_decode(plan, plan.prefill.min_q, torch.empty(1))
    decode_only = attn.plan_launch(num_seqs=2, num_q_heads=4, num_kv_heads=2, head_size=64,
                                   max_query_len=1, sms=132, workspace=None)  # fmt: skip
    assert not attn.run._skips_decode(decode_only, 1, torch.empty(1))


def test_split_rule_follows_batch_size():
    """Hq=32, Hkv=8, D=128 bf16 on 132 SMs. Two schedules, each with its own split count: 3
    stages with two programs per SM (264 slots, kv-head-fastest grid) or 5 stages with one
    (132 slots). 5 stages only for a batch that is not cut by length and that they run
    unsplit and fill the waves of clearly better; batches of 2 to 128 sequences are cut (B=48
    too, which 5 stages would fill better unsplit: 384 programs fill 97% of 132 x 3 waves, 73%
    of 264 x 2). As many splits
    as fill one wave (B=1: 33 x 8 = 264 programs), none once the batch fills it, the split
    count of least modelled time in between (B=20: 3 splits = 480 programs = two waves nearly
    full)."""
    ws = AttentionWorkspace.allocate(256, 32, 128, CPU, max_splits=64)
    batches = (1, 2, 4, 8, 16, 20, 32, 48, 64, 256)
    plans = [
        attn.plan_launch(num_seqs=b, num_q_heads=32, num_kv_heads=8, head_size=128,
                         max_query_len=1, sms=132, workspace=ws).decode
        for b in batches
    ]  # fmt: skip
    assert [p.num_stages for p in plans] == [3] * 10
    assert [p.num_splits for p in plans] == [33, 16, 8, 4, 2, 3, 1, 1, 1, 1]
    # A batch of several sequences is cut by length (balanced split): into as many pieces as
    # its equal-length splits, or one more piece per sequence where it has no split, up to
    # BALANCED_UNSPLIT_MAX_SEQS (128) sequences.
    assert [p.split_budget for p in plans] == [0, 32, 32, 32, 32, 60, 32, 48, 64, 0]
    assert (
        attn.plan_launch(
            num_seqs=48,
            num_q_heads=32,
            num_kv_heads=8,
            head_size=128,
            max_query_len=1,
            sms=132,
            workspace=None,
        ).decode.num_stages
        == 5
    )
    for b, p in zip(batches, plans, strict=True):
        assert (p.tile_n, p.num_warps, p.fused_reduce) == (128, 4, True)
        assert p.head_fast == (p.num_stages == attn.DECODE_STAGES)
        slots = 132 * (2 if p.num_stages == attn.DECODE_STAGES else 1)
        if b * 8 < slots:
            costs = [attn.split_cost(b * 8, s, slots) for s in range(1, 65)]
            assert costs[p.num_splits - 1] == min(costs)
    assert attn.wave_fill(128, 132) == 128 / 132 and attn.wave_fill(384, 264) == 384 / 528
    # No workspace: unsplit.
    no_ws = attn.plan_launch(num_seqs=1, num_q_heads=32, num_kv_heads=8, head_size=128,
                             max_query_len=1, sms=132, workspace=None)  # fmt: skip
    assert no_ws.decode.num_splits == 1


def test_tile_rules():
    """Decode: 128 KV tokens per step (64 at D=256), 4 warps, 3 stages. Its shared memory as
    Triton 3.6 compiles it for sm_90a (74240 / 140288 / 206336 bytes at 3 / 5 / 7 stages, tile
    128; 105216 at tile 64, 7 stages) and the programs per SM that follow. Prefill: 256x64
    tiles, 16 warps, 7 stages for D in (64, 128] (the measured H200 winner, 2026-11-26), 128x64
    at 64."""
    assert attn.plan._decode_tile(1, 4, 128) == (16, 128, 4, 3)
    assert attn.plan._decode_tile(8, 16, 128) == (128, 128, 8, 3)
    assert attn.plan._decode_tile(1, 4, 256)[1] == 64
    assert [attn.kv_buffers(s) for s in (2, 3, 4, 5, 6, 7)] == [1, 1, 1, 2, 2, 3]
    smem = [attn.decode_smem_bytes(16, 128, 128, s, 2) for s in (3, 5, 7)]
    assert smem == [74240, 140288, 206336]
    assert attn.decode_smem_bytes(16, 64, 128, 7, 2) == 105216
    per_sm = attn.decode_programs_per_sm
    assert [per_sm(16, 128, 128, 4, s, 2) for s in (3, 5, 7)] == [2, 1, 1]
    assert per_sm(16, 64, 128, 4, 7, 2) == 2
    assert per_sm(128, 128, 128, 8, 3, 2) == 1
    assert attn.plan._decode_tile(1, 4, 128, attn.DECODE_STAGES_PIPELINED)[3] == 5
    assert attn.plan._prefill_tile(4, 64) == (128, 64, 4, 3)
    for d in (80, 96, 128):
        assert attn.plan._prefill_tile(4, d) == (256, 64, 16, 7)
    assert attn.plan._prefill_tile(4, 256) == (64, 64, 8, 2)
    # Launches that would not fill the GPU twice with 256-row tiles take 128-row ones.
    assert attn.plan._prefill_tile(4, 128, programs=263, sms=132) == (128, 64, 4, 3)
    assert attn.plan._prefill_tile(4, 128, programs=264, sms=132) == (256, 64, 16, 7)
    plan = attn.plan_launch(num_seqs=1, num_q_heads=32, num_kv_heads=8, head_size=128,
                            max_query_len=512, sms=132, workspace=None)  # fmt: skip
    assert plan.prefill.block_m == 128
    # Shared memory of the 256x64 tile as Triton 3.6 compiles it for sm_90a (5 stages), and the
    # stage fallbacks of devices with less per block: A100 (163 KiB), sm_89 (99 KiB).
    assert attn.prefill_smem_bytes(256, 64, 128, 5, 2) == 164352
    assert attn.prefill_smem_bytes(256, 64, 128, 7, 2) <= attn.SMEM_PER_BLOCK_MAX
    assert attn.plan._prefill_tile(4, 128, 264, 132, max_smem=163 * 1024) == (256, 64, 16, 5)
    assert attn.plan._prefill_tile(4, 128, 264, 132, max_smem=99 * 1024) == (128, 64, 4, 3)
    assert attn.plan._prefill_tile(4, 128, 264, 132, max_smem=99 * 1024, kv_bytes=1) == (
        128,
        64,
        4,
        3,
    )
    small_gpu = attn.plan_launch(num_seqs=4, num_q_heads=32, num_kv_heads=8, head_size=128,
                                 max_query_len=8192, sms=108, workspace=None,
                                 max_smem=163 * 1024)  # fmt: skip
    assert (small_gpu.prefill.num_warps, small_gpu.prefill.num_stages) == (16, 5)
    assert attn.plan._prefill_tile(256, 128)[0] == 256  # a whole GQA group per tile


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("head_fast", [False, True])
def test_merge_and_grid_order_variants(fused, head_fast):
    """The benchmark's decode variants: the split merge fused into the decode kernel (counters
    back to zero, checked by run_case) or as a second launch, either grid order; decode and
    verify rows with sinks, a window and a later query chunk (stale max_query_len)."""
    batch = make_batch([1, 3, 1, 12], [700, 40, 1, 300], num_q_heads=8, num_kv_heads=2,
                       head_size=64, block_size=16, seed=11)  # fmt: skip
    batch["max_query_len"] = 3  # the 12-token query runs through the decode kernel in chunks
    ws = workspace(8, 64, max_splits=4)
    # Each sequence in equal splits (the balanced split, which merges fused only, has its own
    # tests in test_attention_balanced.py).
    plan = plan_for(batch, ws, fused_reduce=fused, head_fast=head_fast, split_budget=0)
    assert plan.prefill is None and plan.decode.num_splits == 4
    sinks = torch.linspace(-1.0, 3.0, 8, device=DEVICE)
    for _ in range(2):  # a second call on the same workspace (a graph replay)
        run_case(batch, workspace=ws, plan=plan, sinks=sinks, sliding_window=200)


@pytest.mark.parametrize("stages,from_tile", [(3, False), (5, True)])
def test_unsplit_decode_at_head_size_256_in_both_kv_loop_forms(stages, from_tile):
    """The unsplit decode kernel at head size 256 (Gemma-2): the 3-stage variant takes pages and
    slots from the token index, the others from the offset in the tile
    (`decode.offsets_from_tile`); both against the reference, across page boundaries."""
    batch = make_batch([1, 1, 1], [1, 200, 1031], num_q_heads=4, num_kv_heads=2,
                       head_size=256, block_size=16, seed=41)  # fmt: skip
    ws = workspace(4, 256)
    plan = plan_for(batch, ws, num_splits=1, split_budget=0, num_stages=stages,
                    head_fast=stages == attn.DECODE_STAGES)  # fmt: skip
    assert attn.decode.offsets_from_tile(False, stages, 256) is from_tile
    run_case(batch, workspace=ws, plan=plan, softcap=30.0)


@pytest.mark.parametrize(
    "block_m,num_warps,from_tile", [(256, 16, True), (256, 8, False), (128, 4, False)]
)
def test_prefill_large_tile_and_both_kv_loop_forms(block_m, num_warps, from_tile):
    """The 256-row tiles long prefills get (tiny batches here get 128 rows), and the KV loop's
    two ways to a tile's pages and slots (`prefill.offsets_from_tile`: from the offset in the
    tile, or from the token index for tiles of more than 16 rows per warp)."""
    batch = make_batch([300, 1, 77], [300, 500, 400], num_q_heads=8, num_kv_heads=2,
                       head_size=128, block_size=16, seed=13)  # fmt: skip
    ws = workspace(8, 128)
    changes = dict(block_m=block_m, num_warps=num_warps, num_stages=5)
    plan = plan_for(batch, ws, prefill_changes=changes)
    assert attn.prefill.offsets_from_tile(plan.prefill) is from_tile
    run_case(batch, workspace=ws, plan=plan, sliding_window=120)


def test_prefill_grid_order_head_fast():
    batch = make_batch([1, 70, 5, 33], [400, 90, 5, 300], num_q_heads=8, num_kv_heads=2,
                       head_size=64, block_size=16, seed=12)  # fmt: skip
    ws = workspace(8, 64)
    plan = plan_for(batch, ws, head_fast=True, prefill_changes=dict(head_fast=True))
    run_case(batch, workspace=ws, plan=plan, sliding_window=50)


# ----------------------------------------------------------------------------------------------
# API surface, custom op, bad input
# ----------------------------------------------------------------------------------------------


def test_capability_constants_and_check_supported():
    assert attn.supported_head_sizes() == SUPPORTED_HEAD_SIZES == (64, 80, 96, 128, 256)
    assert SUPPORTED_BLOCK_SIZES == (16, 32, 64)
    attn.check_supported(head_size=128, block_size=16, q_dtype=torch.bfloat16,
                         kv_cache_dtype=FP8_E4M3, num_q_heads=32, num_kv_heads=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"head_size: expected one of \[64, 80, 96, 128, 256\]"):
        attn.check_supported(head_size=112)
    with pytest.raises(ValueError, match=r"block_size: expected one of \[16, 32, 64\], got 128"):
        attn.check_supported(block_size=128)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        attn.check_supported(kv_cache_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads=3"):
        attn.check_supported(num_q_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="at most 128 query heads per kv head"):
        attn.check_supported(num_q_heads=256, num_kv_heads=1)


def test_registered_as_custom_op_with_fake():
    """Mutated arguments are declared (torch.compile must not reorder around the writes) and
    the fake implementation runs on meta tensors without touching data."""
    schema = str(torch.ops.fuselane.paged_attention.default._schema)
    for arg in ("out", "ws_partial_out", "ws_partial_ml", "ws_counters", "ws_schedule"):
        assert "!)" in schema.split(arg)[0].rsplit(",", 1)[-1], f"{arg} not declared mutated"
    batch = make_batch([1], [10], num_q_heads=2, num_kv_heads=1, head_size=64, block_size=16)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}  # fmt: skip
        result = torch.ops.fuselane.paged_attention(
            fake["q"], fake["key_cache"], fake["value_cache"], torch.empty_like(fake["q"]),
            fake["cu_seqlens_q"], fake["seq_lens"], fake["block_table"], 1, 0.125, 0, 0.0,
            None, None, None, None, None, None, None, 0, 0,
        )  # fmt: skip
    assert result is None


@pytest.mark.parametrize(
    "q_lens,seq_lens", [([1, 20], [9, 20]), ([1, 1, 1], [40, 7, 300])], ids=["mixed", "balanced"]
)
def test_opcheck(q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, num_q_heads=2, num_kv_heads=1, head_size=64,
                       block_size=16)  # fmt: skip
    batch.pop("num_rows")
    ws = workspace(2, 64, max_splits=2, rows=4)
    if len(q_lens) == 3:  # the balanced split's schedule goes through the op's workspace
        assert plan_for(batch, ws).decode.split_budget > 0
    args = (
        batch["q"], batch["key_cache"], batch["value_cache"], nan_out(batch["q"]),
        batch["cu_seqlens_q"], batch["seq_lens"], batch["block_table"], batch["max_query_len"],
        batch["scale"], 0, 0.0, None, None, None, ws.partial_out, ws.partial_ml, ws.counters,
        ws.schedule, ws.max_num_tokens, ws.max_splits,
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.fuselane.paged_attention.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def _bad_inputs():
    """(name, mutate(args) -> None, message regex) for every check the launcher makes."""
    fp8 = FP8_E4M3

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    def ones(*shape, dtype=torch.float32):
        return torch.ones(*shape, dtype=dtype, device=DEVICE)

    def set_(key, value):
        return lambda a: a.__setitem__(key, value)

    def with_(key, fn):
        return lambda a: a.__setitem__(key, fn(a[key]))

    def both(fn):  # the same change to key_cache and value_cache
        return lambda a: a.update(key_cache=fn(a["key_cache"]), value_cache=fn(a["value_cache"]))

    return [
        ("q not a tensor", set_("q", [1.0]), "q: expected a torch.Tensor"),
        (
            "q fp64",
            with_("q", lambda t: t.double()),
            r"q: expected dtype in \(float16, bfloat16, float32\)",
        ),
        ("q 2-D", with_("q", lambda t: t[:, 0]), "q: expected 3 dimensions"),
        ("q strided head dim", with_("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
         "q: expected stride 1 in the last dimension"),
        ("cache dtype", with_("key_cache", lambda t: t.half()), "key_cache: expected dtype in"),
        ("cache ndim", with_("key_cache", lambda t: t[0]), "key_cache: expected 4 dimensions"),
        ("value shape", with_("value_cache", lambda t: t[:, :8]), "value_cache: expected shape"),
        ("value dtype", with_("value_cache", lambda t: t.to(fp8)), "value_cache: expected dtype"),
        ("head size mismatch", both(lambda t: t[..., :32]), "key_cache: expected head size 64"),
        ("block size", both(lambda t: t[:, :8]),
         r"block_size: expected one of \[16, 32, 64\], got 8"),
        ("group", with_("q", lambda t: t[:, :3]), "num_q_heads: expected a positive multiple"),
        ("out dtype", with_("out", lambda t: t.float()), "out: expected dtype"),
        ("out shape", with_("out", lambda t: t[:-1]), "out: expected shape"),
        ("cu dtype", with_("cu_seqlens_q", lambda t: t.long()), "cu_seqlens_q: expected dtype"),
        ("cu empty", with_("cu_seqlens_q", lambda t: t[:0]),
         r"cu_seqlens_q: expected shape \[num_seqs \+ 1\]"),
        ("seq_lens shape", with_("seq_lens", lambda t: t[:1]), r"seq_lens: expected shape \[2\]"),
        ("seq_lens dtype", with_("seq_lens", lambda t: t.long()), "seq_lens: expected dtype"),
        ("block_table rows", with_("block_table", lambda t: t[:1]), "block_table: expected shape"),
        ("block_table strided", with_("block_table", lambda t: t.t().contiguous().t()),
         "block_table: expected stride 1"),
        ("block_table dtype", with_("block_table", lambda t: t.long()),
         "block_table: expected dtype"),
        ("max_query_len", set_("max_query_len", -1), "max_query_len: expected an int >= 0"),
        ("max_seq_len", set_("max_seq_len", 2.5), "max_seq_len: expected an int >= 0"),
        ("min_query_len above max", set_("min_query_len", 6),
         r"min_query_len: expected an int in \[0, max_query_len=5\] \(0 = unknown\), got 6"),
        ("min_query_len negative", set_("min_query_len", -1), "min_query_len: expected an int"),
        ("scale", set_("scale", 0.0), "scale: expected a finite float > 0"),
        ("scale nan", set_("scale", float("nan")), "scale: expected a finite float > 0"),
        ("softcap", set_("softcap", -1.0), "softcap: expected a finite float >= 0"),
        ("window", set_("sliding_window", 0), "sliding_window: expected None or an int >= 1"),
        ("sinks shape", set_("sinks", zeros(3)), r"sinks: expected shape \[4\]"),
        ("sinks dtype", set_("sinks", zeros(4, dtype=torch.bfloat16)), "sinks: expected dtype"),
        ("fp8 without scales", both(lambda t: t.to(fp8)), "k_scale: required for a float8_e4m3fn"),
        ("scale shape", set_("k_scale", ones(2)), "k_scale: expected one element"),
        ("scale dtype", set_("v_scale", ones(1, dtype=torch.float16)), "v_scale: expected dtype"),
        ("workspace type", set_("workspace", object()),
         "workspace: expected an AttentionWorkspace"),
    ]  # fmt: skip


@pytest.mark.parametrize("name,mutate,message", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_rejects_bad_input(name, mutate, message):
    batch = make_batch([1, 5], [10, 5], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    batch.pop("num_rows")
    args = dict(batch, out=nan_out(batch["q"]))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def test_rejects_non_finite_window_types_and_devices():
    batch = make_batch([1], [10], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    batch.pop("num_rows")
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(out=nan_out(batch["q"]), **batch, sliding_window=True)
    meta = dict(batch, seq_lens=batch["seq_lens"].to("meta"))
    with pytest.raises(ValueError, match=f"seq_lens: expected device {DEVICE.type}"):
        paged_attention(out=nan_out(batch["q"]), **meta)


def test_workspace_allocate_validates_and_sizes():
    ws = AttentionWorkspace.allocate(3, 4, 80, CPU, max_splits=5)
    assert ws.partial_out.numel() == 3 * 4 * 5 * 128 and ws.partial_ml.numel() == 3 * 4 * 5 * 2
    assert ws.partial_out.dtype == torch.float32
    assert ws.counters.dtype == torch.int32 and ws.counters.numel() == 3 * 4
    assert int(ws.counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="max_num_tokens: expected a positive int"):
        AttentionWorkspace.allocate(0, 4, 64, CPU)
    with pytest.raises(ValueError, match="head_size: expected one of"):
        AttentionWorkspace.allocate(4, 4, 100, CPU)


def test_empty_batch_is_a_no_op():
    batch = make_batch([], [], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    batch.pop("num_rows")
    out = nan_out(batch["q"])
    paged_attention(out=out, **batch)
    assert torch.isnan(out).all()


def test_reference_matches_dense_sdpa():
    """The reference itself against torch SDPA on a dense causal MHA problem (no paging)."""
    batch = make_batch([37], [37], num_q_heads=2, num_kv_heads=2, head_size=64, block_size=16,
                       q_dtype=torch.float16)  # fmt: skip
    batch.pop("num_rows")
    out = nan_out(batch["q"])
    paged_attention_reference(out=out, **batch)
    pages = batch["block_table"][0, :3].long()
    k = batch["key_cache"][pages].reshape(-1, 2, 64)[:37].float()
    v = batch["value_cache"][pages].reshape(-1, 2, 64)[:37].float()
    q = batch["q"][:37].float()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert_close(out[:37], want, atol=2e-3, rtol=2e-3, what="reference vs SDPA")


# ----------------------------------------------------------------------------------------------
# Start-up compilation of every variant
# ----------------------------------------------------------------------------------------------


def _variant(plan: attn.LaunchPlan) -> tuple:
    """What makes a compiled variant: the plan without its split count and budget (runtime
    arguments, not specialized)."""
    dec = dataclasses.replace(
        plan.decode,
        num_splits=min(plan.decode.num_splits, 2),
        split_budget=min(plan.decode.split_budget, 2),
    )
    return dec, plan.prefill


@pytest.mark.parametrize(
    ("hq", "hkv", "d"), [(32, 8, 128), (28, 4, 128), (64, 1, 128), (16, 8, 256)]
)
@pytest.mark.parametrize("warp_specialized", [False, True])
def test_reachable_plans_cover_every_batch(hq, hkv, d, warp_specialized):
    """Every plan plan_launch makes for 1..600 sequences and query lengths 1..20 is, up to its
    split count, one of reachable_plans: warming those up leaves nothing to compile later
    (with and without Hopper's warp-specialized prefill kernel)."""
    ws = AttentionWorkspace.allocate(512, hq, d, CPU, max_splits=64)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_size=d, sms=132, workspace=ws,
              warp_specialized=warp_specialized)  # fmt: skip
    reachable = {_variant(p) for p in attn.reachable_plans(**kw)}
    seen = {
        _variant(attn.plan_launch(num_seqs=b, max_query_len=q, **kw))
        for b in range(1, 601)
        for q in (*range(1, 21), 512, 2048, 4096, 16384)
    }
    assert seen == reachable
    # Start-up compiles each one; Hopper's warp-specialized decode kernel adds one variant, the
    # balanced split (batches of several sequences) one per split tile beside the plain split
    # (one sequence), and the unsplit one beyond BALANCED_UNSPLIT_MAX_SEQS sequences stays
    # (18 for 7 query heads per kv head).
    assert len(reachable) <= 18 + warp_specialized


def test_warm_up_launches_each_variant_without_touching_the_cache():
    batch = make_batch([1], [40], num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       seed=5)  # fmt: skip
    ws = workspace(8, 64)
    k_before = batch["key_cache"].clone()
    v_before = batch["value_cache"].clone()
    launched = attn.warm_up(
        batch["key_cache"], batch["value_cache"], batch["block_table"][:1], num_q_heads=8,
        q_dtype=batch["q"].dtype, options=attn.AttentionOptions(scale=0.125), workspace=ws,
    )  # fmt: skip
    assert launched == len(
        attn.reachable_plans(
            num_q_heads=8, num_kv_heads=2, head_size=64, sms=attn.CPU_SM_COUNT, workspace=ws
        )
    )
    for cache, before in ((batch["key_cache"], k_before), (batch["value_cache"], v_before)):
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # NaN pages too
    assert int(ws.counters.abs().sum()) == 0  # the fused merges left their counters at zero

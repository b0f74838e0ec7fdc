"""The decode kernel's balanced split: a batch's KV cut into pieces by length on the device.

Every case runs the decode kernel with a given `split_budget` against the reference (outputs
poisoned, the workspace's counters back at zero after, as `run_case` checks), and where it
says so also checks which partials the launch wrote: the workspace's (m, l) array is poisoned
with NaN first, and exactly the columns of the sequences cut into several pieces
(`attn.balanced_pieces`, the host mirror of the kernel's schedule) must hold values after.
Runs under Triton's interpreter on the CPU and on the GPU as it is.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from fuselane.kernels import attention as attn
from fuselane.kernels._checks import FP8_E4M3
from tests.device import DEVICE
from tests.kernels.test_attention import (
    assert_matches_reference,
    attention_options,
    make_batch,
    nan_out,
    paged_batch,
    plan_for,
    run_case,
    workspace,
)


def _tiles(q_lens: list[int], seq_lens: list[int], tile_n: int, window: int | None,
           max_q: int) -> list[int]:  # fmt: skip
    """KV tiles the balanced split counts per sequence (`balance._seq_tiles`): a decode-only
    launch (max_q 0) reads the lengths alone, as if every query were one token."""
    out = []
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        if max_q == 0:
            q_len = 1
        elif q_len <= 0 or q_len > max_q:
            out.append(0)
            continue
        kv_lo = max(seq_len - q_len - window + 1, 0) if window else 0
        out.append(math.ceil(seq_len / tile_n) - kv_lo // tile_n if seq_len > 0 else 0)
    return out


def _written_columns(ws: attn.AttentionWorkspace, qpos: int, num_q_heads: int, items: int) -> int:
    """Columns of (position 0, head 0) in the balanced partial layout holding a value."""
    m = ws.partial_ml.view(-1, 2)[: qpos * num_q_heads * items, 0].view(qpos, num_q_heads, items)
    return int((~torch.isnan(m[0, 0])).sum())


@pytest.fixture
def triton_decode(monkeypatch):
    """The Triton decode kernel for every plan of the test, whatever the rule gives Hopper's
    warp-specialized decode kernel (it reads no schedule; a rule that gave it these small
    batches, as one did, left the replay tests checking nothing on an sm_90 GPU)."""
    monkeypatch.setattr(attn.hopper, "_hopper_off", attn.hopper_kernels_off())  # undone after
    attn.disable_hopper_kernels("the test checks the Triton decode kernel's schedule")
    yield
    attn.ops.LAUNCHES.clear()  # no Triton-only recording outlives the test


# (q_lens, seq_lens, Hq, Hkv, D, block, budget, options)
CASES = [
    # one long sequence among short ones: the long one in many pieces, the short ones whole
    ([1] * 6, [1, 16, 17, 3000, 40, 2], 4, 2, 64, 16, 6, {}),
    # every budget from one piece for the batch to more pieces than tiles
    ([1, 1, 1], [700, 129, 1], 4, 1, 128, 32, 1, {}),
    ([1, 1, 1], [700, 129, 1], 4, 1, 128, 32, 3, {}),
    ([1, 1, 1], [700, 129, 1], 4, 1, 128, 32, 40, {}),
    # GQA 5, head size 80 (padded tile), page boundaries
    ([1, 1, 1, 1], [64, 65, 1999, 128], 5, 1, 80, 64, 8, {}),
    # padding requests (query_len 0) take no piece
    ([1, 0, 1, 0], [900, 0, 33, 0], 4, 2, 64, 16, 4, {}),
    # window, soft cap and sinks with pieces: the window's tiles only are cut
    (
        [1, 1, 1],
        [1500, 30, 700],
        8,
        2,
        64,
        16,
        6,
        dict(sliding_window=300, softcap=20.0, sinks=True),
    ),
    # speculative-verify rows (several query positions per tile)
    ([3, 1, 2, 4], [600, 20, 800, 5], 4, 2, 128, 16, 8, {}),
]


@pytest.mark.parametrize("case", CASES)
def test_balanced_split_matches_reference_and_schedule(case):
    q_lens, seq_lens, hq, hkv, d, block, budget, options = case
    batch = make_batch(q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_size=d,
                       block_size=block, seed=sum(seq_lens) + budget)  # fmt: skip
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-2.0, 2.0, hq, device=batch["q"].device)
    ws = workspace(hq, d, max_splits=8, rows=16)
    plan = plan_for(batch, ws, split_budget=budget)
    dec = plan.decode
    items = len(seq_lens) + budget
    ws.partial_ml.fill_(float("nan"))
    for _ in range(2):  # a second call on the same workspace (a graph replay)
        run_case(batch, workspace=ws, plan=plan, **options)
    tiles = _tiles(q_lens, seq_lens, dec.tile_n, options.get("sliding_window"), dec.max_q)
    pieces = attn.balanced_pieces(tiles, budget)
    assert sum(pieces) <= items
    assert _written_columns(ws, dec.qpos, hq, items) == sum(p for p in pieces if p > 1)


def test_balanced_split_beyond_one_scan_block():
    """More sequences than one block of the schedule's scan (two passes over the lengths);
    ~281 tiles in 140 pieces: chunk 3, so the two long sequences are cut."""
    n = attn.balance.BALANCE_SCAN.value + 7
    seq_lens = [1 + (i * 37) % 50 for i in range(n)]
    seq_lens[200] = 1500  # a long one in the first block, another in the second
    seq_lens[n - 3] = 900
    batch = make_batch([1] * n, seq_lens, num_q_heads=2, num_kv_heads=1, head_size=64,
                       block_size=16, seed=23)  # fmt: skip
    ws = workspace(2, 64, max_splits=4, rows=n)
    plan = plan_for(batch, ws, split_budget=140)
    ws.partial_ml.fill_(float("nan"))
    run_case(batch, workspace=ws, plan=plan)
    pieces = attn.balanced_pieces(_tiles([1] * n, seq_lens, plan.decode.tile_n, None, 0), 140)
    assert pieces[200] > 1 and pieces[n - 3] > 1
    assert _written_columns(ws, 1, 2, n + 140) == sum(p for p in pieces if p > 1)


def test_balanced_split_in_a_mixed_batch_leaves_prefill_rows_to_the_prefill_kernel():
    """Prefill chunks take no piece of the decode launch (their tiles are not counted)."""
    batch = make_batch([1, 90, 1, 3], [2000, 190, 40, 400], num_q_heads=4, num_kv_heads=2,
                       head_size=128, block_size=16, seed=21)  # fmt: skip
    ws = workspace(4, 128, max_splits=8, rows=16)
    plan = plan_for(batch, ws, split_budget=5)
    assert plan.prefill is not None and plan.decode.max_q > 0
    run_case(batch, workspace=ws, plan=plan, sliding_window=500)


def test_balanced_split_fp8_cache_and_grid_orders():
    batch = make_batch([1] * 5, [1, 300, 47, 1200, 16], num_q_heads=4, num_kv_heads=2,
                       head_size=128, block_size=16, kv_dtype=FP8_E4M3, seed=22)  # fmt: skip
    ws = workspace(4, 128, max_splits=8, rows=16)
    for head_fast in (True, False):
        run_case(batch, workspace=ws, plan=plan_for(batch, ws, split_budget=7, head_fast=head_fast))


def test_balanced_split_needs_the_fused_merge():
    batch = make_batch([1], [40], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    ws = workspace(4, 64)
    plan = plan_for(batch, ws, split_budget=2, fused_reduce=False)
    with pytest.raises(ValueError, match=r"split_budget > 0.*fused_reduce=False"):
        run_case(batch, workspace=ws, plan=plan)


def test_balanced_pieces_bound_and_balance():
    """At most budget + B pieces for any lengths, none longer than cdiv(total, budget) tiles,
    and a batch of equal lengths cut as the per-sequence split with budget = B x splits."""
    rng = random.Random(5)
    for _ in range(500):
        tiles = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 200)
        pieces = attn.balanced_pieces(tiles, budget)
        chunk = max(-(-sum(tiles) // budget), 1)
        assert sum(pieces) <= budget + len(tiles)
        assert all(-(-t // p) <= chunk for t, p in zip(tiles, pieces, strict=True) if t)
        assert all(p == 0 for t, p in zip(tiles, pieces, strict=True) if t == 0)
    assert attn.balanced_pieces([256] * 4, 4 * 8) == [8] * 4
    assert attn.balanced_pieces([256, 2, 2, 2], 4) == [4, 1, 1, 1]  # chunk 66


def test_workspace_budget_counts_items_and_counters():
    ws = attn.split_room(workspace(4, 64, max_splits=4, rows=8))  # 8 x 4 x 4 rows of 64
    # 32 columns of 4 heads: 32 - B items of budget; counters 8 x 4 = 32 (sequence, kv head).
    assert attn.workspace_budget(ws, 1, 4, 64, 3, 2) == 29
    assert attn.workspace_budget(ws, 2, 4, 64, 3, 2) == 13  # two positions per column
    assert attn.workspace_budget(ws, 1, 4, 64, 17, 2) == 0  # 34 counters needed
    assert attn.workspace_budget(ws, 1, 4, 64, 40, 1) == 0  # no column left


def test_balanced_config_is_a_distinct_compiled_variant():
    """split_budget changes the grid and a constexpr: the warm-up must know it (see the rule)."""
    plan = attn.plan_launch(num_seqs=2, num_q_heads=4, num_kv_heads=2, head_size=64,
                            max_query_len=1, sms=132, workspace=None)  # fmt: skip
    assert dataclasses.replace(plan.decode, split_budget=3) != plan.decode


def _expected_schedule(pieces: list[int], items: int) -> list[tuple[int, int, int]]:
    """(sequence, piece, pieces) of each decode program, from the host mirror's counts."""
    rows = [(s, k, p) for s, p in enumerate(pieces) for k in range(p)]
    return rows + [(None, None, None)] * (items - len(rows))


@pytest.mark.parametrize(
    "seq_lens, q_lens, tile_n, window, max_q, budget",
    [
        ([1, 16, 17, 3000, 40, 2], None, 16, 0, 0, 6),
        ([700, 129, 1], None, 32, 0, 0, 1),
        ([700, 129, 1], None, 32, 0, 0, 40),  # more pieces than tiles
        ([900, 0, 33, 0, 5000], None, 64, 0, 0, 10),  # padding takes no piece
        ([1500, 30, 700, 4000], None, 16, 300, 0, 9),  # the window's tiles only
        ([2000, 190, 40, 400], [1, 90, 1, 3], 16, 0, 8, 5),  # the prefill chunk takes none
        # more sequences than one block of the kernel's scan, long ones in both blocks
        ([1 + (i * 37) % 50 if i not in (3, 200, 280) else 4000 for i in range(283)], None,
         16, 0, 0, 200),
    ],
)  # fmt: skip
def test_schedule_kernel_matches_the_host_mirror(seq_lens, q_lens, tile_n, window, max_q, budget):
    """Every entry of the schedule table, against `balanced_pieces` over the same tile counts."""
    q_lens = q_lens or [1 if s > 0 else 0 for s in seq_lens]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    device = DEVICE
    batch = attn.PagedBatch(
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.zeros(len(seq_lens), 1, dtype=torch.int32, device=device),
        max(q_lens),
    )
    ws = workspace(2, 64, max_splits=4, rows=len(seq_lens) + budget)
    table = attn.balance.balanced_schedule(batch, ws, budget, tile_n, max_q, window).cpu()
    items = len(seq_lens) + budget
    assert tuple(table.shape) == (items, attn.balance.ENTRY.value)
    pieces = attn.balanced_pieces(_tiles(q_lens, seq_lens, tile_n, window or None, max_q), budget)
    for item, (got, want) in enumerate(zip(table.tolist(), _expected_schedule(pieces, items),
                                           strict=True)):  # fmt: skip
        if want[0] is None:
            assert got[0] >= len(seq_lens), f"item {item}: {got} past the last piece"
        else:
            assert tuple(got[:3]) == want, f"item {item}: {got[:3]} != {want}"


def test_schedule_is_written_once_per_batch_and_again_after_an_in_place_update():
    def batch_of(lens: list[int]) -> attn.PagedBatch:
        n = len(lens)
        return attn.PagedBatch(
            torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            torch.zeros(n, 1, dtype=torch.int32, device=DEVICE),
            1,
        )

    ws = workspace(2, 64, max_splits=4, rows=8)
    schedule = attn.balance.balanced_schedule
    batch = batch_of([3000, 5])
    first = schedule(batch, ws, 8, 16, 0, 0)
    assert first.data_ptr() == ws.schedule.data_ptr()  # a view of the workspace's first slot
    assert schedule(batch, ws, 8, 16, 0, 0) is first
    assert schedule(batch, ws, 8, 32, 0, 0) is not first  # another tile: another slot
    batch.seq_lens[1] = 4000  # an in-place update: the lengths' version changes
    again = schedule(batch, ws, 8, 16, 0, 0)
    assert again is not first
    # rewritten for the new lengths: 188 + 250 tiles in pieces of <= 55 (was 188 + 1 in <= 24)
    assert attn.balanced_pieces([188, 250], 8) == [4, 5]
    assert first[:9, 0].tolist() == [0] * 8 + [1]
    assert again[:9, 0].tolist() == [0] * 4 + [1] * 5
    written = again.tolist()
    # Other batches take every slot in turn: the first batch's schedule is written again (into
    # the next free slot), not read from a slot another batch wrote.
    for i in range(attn.workspace.SCHEDULE_SLOTS):
        schedule(batch_of([100 * (i + 1), 7]), ws, 8, 16, 0, 0)
    assert not attn.balance.schedules_hold(batch, ws)
    fresh = schedule(batch, ws, 8, 16, 0, 0)
    assert fresh is not again and attn.balance.schedules_hold(batch, ws)
    assert fresh.tolist() == written
    with pytest.raises(ValueError, match=r"split_budget: 40 pieces for 2 sequences need 42"):
        schedule(batch_of([10, 10]), ws, 40, 16, 0, 0)


def test_a_replay_does_not_read_a_slot_another_batch_took(triton_decode):
    """The unchecked entry point replays a step's first layer's launches for its later layers
    only while the step's schedule still holds its workspace slot: here other batches took
    every slot between two layers, and the second layer runs anew."""
    batch = make_batch([1, 1, 1], [1500, 40, 700], num_q_heads=8, num_kv_heads=2,
                       head_size=128, block_size=16, seed=33)  # fmt: skip
    others = make_batch([1, 1], [900, 30], num_q_heads=8, num_kv_heads=2, head_size=128,
                        block_size=16, seed=34)  # fmt: skip
    ws = workspace(8, 128, max_splits=8, rows=16)
    assert plan_for(batch, ws).decode.split_budget > 0
    assert plan_for(others, ws).decode.split_budget > 0  # the others take schedule slots
    options = attention_options(batch)
    q, kc, vc = batch["q"], batch["key_cache"], batch["value_cache"]
    step = paged_batch(batch)
    attn.attention_unchecked(q, kc, vc, nan_out(q), step, options, ws)
    for _ in range(attn.workspace.SCHEDULE_SLOTS):
        o = others
        attn.attention_unchecked(o["q"], o["key_cache"], o["value_cache"], nan_out(o["q"]),
                                 paged_batch(o), attention_options(o), ws)  # fmt: skip
    hits = attn.ops.LAUNCHES.hits
    out = nan_out(q)
    attn.attention_unchecked(q, kc, vc, out, step, options, ws)
    assert attn.ops.LAUNCHES.hits == hits
    assert_matches_reference(batch, out)


def test_replayed_layers_read_their_batch_schedule_and_an_updated_one_writes_anew(triton_decode):
    """vLLM's later layers replay the first one's recorded decode launch (`attention_unchecked`)
    without the schedule launch. A batch whose lengths change in place must not replay a
    schedule of the old lengths: there a sequence that was padding has no piece, its rows
    would stay NaN."""
    batch = make_batch([1, 1, 1], [1500, 40, 700], num_q_heads=8, num_kv_heads=2,
                       head_size=128, block_size=16, seed=31)  # fmt: skip
    ws = workspace(8, 128, max_splits=8, rows=16)
    assert plan_for(batch, ws).decode.split_budget > 0, "the rule should balance this batch"
    cu, lens = batch["cu_seqlens_q"], batch["seq_lens"]
    full_cu, full_lens = cu.clone(), lens.clone()
    paged = paged_batch(batch)
    options = attention_options(batch)
    q, kc, vc = batch["q"], batch["key_cache"], batch["value_cache"]
    # Step 1: sequence 1 is padding (no query, no keys).
    cu.copy_(torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=DEVICE))
    lens.copy_(torch.tensor([1500, 0, 700], dtype=torch.int32, device=DEVICE))
    hits = attn.ops.LAUNCHES.hits
    for _ in range(2):  # a step's first layer, then a replayed one
        out = nan_out(q)
        attn.attention_unchecked(q, kc, vc, out, paged, options, ws)
    assert attn.ops.LAUNCHES.hits == hits + 1
    assert_matches_reference(batch, out, 2)
    # Step 2, same batch object and tensors: sequence 1 has its query and keys again.
    cu.copy_(full_cu)
    lens.copy_(full_lens)
    out = nan_out(q)
    attn.attention_unchecked(q, kc, vc, out, paged, options, ws)
    assert_matches_reference(batch, out)


def test_inference_tensors_as_vllm_makes_them(triton_decode):
    """vLLM runs its steps under torch.inference_mode, where tensors it creates have no version
    counter: a step's first layer writes the schedule and a later one replays, as elsewhere."""
    batch = make_batch([1, 1, 1], [1500, 40, 700], num_q_heads=8, num_kv_heads=2,
                       head_size=128, block_size=16, seed=35)  # fmt: skip
    ws = workspace(8, 128, max_splits=8, rows=16)
    q, kc, vc = batch["q"], batch["key_cache"], batch["value_cache"]
    options = attention_options(batch)
    with torch.inference_mode():
        step = attn.PagedBatch(batch["cu_seqlens_q"].clone(), batch["seq_lens"].clone(),
                               batch["block_table"], 1)  # fmt: skip
        assert step.seq_lens.is_inference() and step.lengths_version() == (-1, -1)
        hits = attn.ops.LAUNCHES.hits
        for _ in range(2):
            out = nan_out(q)
            attn.attention_unchecked(q, kc, vc, out, step, options, ws)
        assert attn.ops.LAUNCHES.hits == hits + 1
    assert_matches_reference(batch, out)

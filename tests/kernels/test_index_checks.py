"""FUSELANE_CHECK_INDICES: bad device-side indices are refused before the launch with an error
naming the tensor, the position, the value and the valid range (the tests run with the checks
on: tests/conftest.py). Each case here faulted, or read or wrote outside a tensor, without it."""

from __future__ import annotations

import pytest
import torch

from fuselane.kernels import attention as attn
from fuselane.kernels import index_checks
from fuselane.kernels import kv_cache as kvc
from fuselane.kernels import sampling as smp
from tests.device import DEVICE
from tests.kernels.test_attention import make_batch, nan_out, paged_batch, workspace
from tests.kernels.test_kv_cache import cache_views, make_cache, make_inputs


def _attention_case():
    batch = make_batch([1, 3], [40, 20], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=2)  # fmt: skip
    return batch, paged_batch(batch)


def _run_attention(batch, pb, entry):
    out = nan_out(batch["q"])
    ws = workspace(4, 64)
    options = attn.AttentionOptions(batch["scale"])
    entry(batch["q"], batch["key_cache"], batch["value_cache"], out, pb, options, ws)
    return out


@pytest.mark.parametrize("entry", ["attention", "attention_unchecked"])
@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b["block_table"].__setitem__((0, 1), 1_000_000), r"block_table\[\(0, 1\)\]"),
        (lambda b: b["block_table"].__setitem__((1, 0), -1), r"block_table\[\(1, 0\)\]"),
        (lambda b: b["block_table"].__setitem__((0, 0), b["key_cache"].shape[0]), "block ids in"),
        (lambda b: b["seq_lens"].__setitem__(0, 10_000), r"seq_lens\[0\].*at most"),
        (lambda b: b["seq_lens"].__setitem__(1, 2), r"seq_lens\[1\].*query length"),
        (lambda b: b["cu_seqlens_q"].__setitem__(2, 99), r"cu_seqlens_q\[2\].*<= q.shape\[0\]"),
    ],
    ids=["table-1e6", "table-negative", "table-num_blocks", "seq-too-long", "seq-short", "cu"],
)
def test_attention_refuses_bad_indices(entry, damage, message):
    batch, pb = _attention_case()
    damage(batch)
    attn.LAUNCHES.clear()
    with pytest.raises(ValueError, match=message):
        _run_attention(batch, pb, getattr(attn, entry))


def test_good_indices_pass_and_checks_off_check_nothing(monkeypatch):
    batch, pb = _attention_case()
    out = _run_attention(batch, pb, attn.attention)
    assert not out[:4].isnan().any()
    monkeypatch.setattr(index_checks, "_enabled", False)
    calls = []
    monkeypatch.setattr(index_checks, "check_paged_batch", lambda *a: calls.append(a))
    _run_attention(batch, pb, attn.attention)
    assert not index_checks.enabled() and calls == []


def _kv_case(slots):
    gen = torch.Generator().manual_seed(4)
    _, key, value = make_inputs(gen, 4, 1, 2, 64, torch.bfloat16, "qkv")
    base = make_cache(2, 16, 2, 64, torch.bfloat16, "nhd")
    kc, vc = cache_views(base, "nhd", 64)
    return kvc.KVWrite(key, value, kc, vc, torch.tensor(slots, device=DEVICE))


@pytest.mark.parametrize(
    "slots,message",
    [
        ([0, 1, 10**12, -1], r"slot_mapping\[2\].*< 32 cache slots"),
        ([0, 1, 35, -1], r"slot_mapping\[2\]"),
        ([5, 6, 5, -1], "distinct slots, got 5"),
    ],
    ids=["1e12", "past-the-end", "duplicate"],
)
@pytest.mark.parametrize("entry", ["kv_write", "kv_write_unchecked"])
def test_kv_write_refuses_bad_slots(slots, message, entry):
    kvc.WRITE_LAUNCHES.clear()
    with pytest.raises(ValueError, match=message):
        getattr(kvc, entry)(_kv_case(slots))


@pytest.mark.parametrize(
    "slots,message",
    [
        ([0, 1, 10**12, -1], r"slot_mapping\[2\].*< 32 cache slots"),
        ([0, 1, 35, -1], r"slot_mapping\[2\]"),
    ],
    ids=["1e12", "past-the-end"],
)
def test_rope_write_refuses_bad_slots(slots, message):
    """The fused RoPE + KV write checks its slots as the plain write does (and rotates nothing
    when it refuses: query and key keep their values)."""
    write = _kv_case(slots)
    query = torch.randn(4, 2, 64, device=DEVICE).to(torch.bfloat16)
    q0, k0 = query.clone(), write.key.clone()
    cos_sin = torch.randn(8, 64, device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        kvc.rope_kv_write(kvc.Rotary(positions, query, cos_sin, True), write)
    assert torch.equal(query, q0) and torch.equal(write.key, k0)


def test_rope_refuses_positions_outside_the_table():
    write = _kv_case([0, 1, 2, 3])
    query = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    cos_sin = torch.zeros(8, 64, device=DEVICE)
    positions = torch.tensor([0, 1, 8, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"positions\[2\].*\[0, 8\)"):
        kvc.rope_kv_write(kvc.Rotary(positions, query, cos_sin, True), write)


def test_sampling_refuses_a_state_slot_and_a_bias_token_out_of_range():
    B, V, S = 2, 100, 3
    logits = torch.randn(B, V, device=DEVICE)
    ws = smp.SamplingWorkspace.allocate(B, V, DEVICE)
    counts = torch.tensor([1, 1, 0], dtype=torch.int32, device=DEVICE)
    toks = torch.tensor([[3], [4], [0]], dtype=torch.int32, device=DEVICE)
    vals = torch.ones(S, 1, device=DEVICE)
    bias = dict(logit_bias_counts=counts, logit_bias_token_ids=toks, logit_bias_values=vals)
    slots = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"params.state_slots\[1\].*\[0, 3\)"):
        smp.fused_sample(logits, smp.SamplingParamsTensors(state_slots=slots, **bias), workspace=ws)
    toks[1, 0] = V + 5
    with pytest.raises(ValueError, match=r"logit_bias_token_ids\[\(1, 0\)\].*\[0, 100\)"):
        smp.fused_sample(logits, smp.SamplingParamsTensors(**bias), workspace=ws)


@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf"), -1.0])
def test_fp8_scales_outside_the_domain(monkeypatch, scale):
    """Without the checks: the reference's result bit for bit (0 saturates to +-448, NaN
    stores NaN); with them: refused by name."""
    gen = torch.Generator().manual_seed(6)
    _, key, value = make_inputs(gen, 4, 1, 2, 64, torch.bfloat16, "qkv")
    fp8 = torch.float8_e4m3fn
    got, want = make_cache(2, 16, 2, 64, fp8, "nhd"), make_cache(2, 16, 2, 64, fp8, "nhd")
    slots = torch.tensor([0, 5, -1, 17], device=DEVICE)
    bad, good = torch.tensor([scale], device=DEVICE), torch.tensor([0.5], device=DEVICE)
    with pytest.raises(ValueError, match=r"k_scale\[0\]: expected a finite scale > 0"):
        kvc.kv_write(kvc.KVWrite(key, value, *cache_views(got, "nhd", 64), slots, bad, good))
    with pytest.raises(ValueError, match=r"v_scale\[0\]: expected a finite scale > 0"):
        kvc.kv_write(kvc.KVWrite(key, value, *cache_views(got, "nhd", 64), slots, good, bad))
    monkeypatch.setattr(index_checks, "_enabled", False)
    kvc.kv_write(kvc.KVWrite(key, value, *cache_views(got, "nhd", 64), slots, bad, good))
    kvc.kv_write_reference(kvc.KVWrite(key, value, *cache_views(want, "nhd", 64), slots, bad, good))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

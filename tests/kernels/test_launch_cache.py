"""Recorded launches replayed layer after layer (kernels/_launch.py `LaunchCache`).

vLLM calls attention and the KV write once per layer with one step's metadata; the unchecked
entry points record the first layer's launches and replay them for the others with their own
tensors. Every test here gives each "layer" its own data (queries, caches, outputs, sinks and
fp8 scales) so a replay that kept any of the recorded layer's tensors would fail.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fuselane.kernels import _launch
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kvc
from fuselane.kernels._checks import FP8_E4M3
from fuselane.kernels._launch import LaunchCache
from tests.allclose import assert_close
from tests.device import DEVICE
from tests.kernels.test_attention import (
    TOL,
    attention_options,
    make_batch,
    nan_out,
    paged_batch,
    workspace,
)
from tests.kernels.test_kv_cache import (
    assert_bitwise_equal,
    cache_views,
    make_cache,
    make_inputs,
    written_elements,
)

LAYERS = 3


def _other_layer(batch: dict, seed: int) -> dict:
    """`batch` with new query and cache data in tensors of the same shapes and strides (the
    NaN poison kept where it was); metadata tensors shared."""
    gen = torch.Generator().manual_seed(seed)
    layer = dict(batch)
    base = batch["key_cache"]._base
    if base.dtype == FP8_E4M3:
        fresh = (base.float().cpu() + torch.randn(base.shape, generator=gen)).to(FP8_E4M3)
    else:
        fresh = (base.float().cpu() * 0.5 + torch.randn(base.shape, generator=gen)).to(base.dtype)
    fresh = fresh.to(DEVICE)
    num_d = batch["q"].shape[2]
    layer["key_cache"], layer["value_cache"] = fresh.split(num_d, dim=-1)
    qkv = batch["q"]._base
    qkv = torch.randn(qkv.shape, generator=gen).to(DEVICE, qkv.dtype)
    layer["q"] = qkv[:, : batch["q"].shape[1] * num_d].view(batch["q"].shape)
    for name in ("k_scale", "v_scale"):
        if name in batch:
            layer[name] = batch[name] * (1.0 + 0.3 * seed)
    return layer


@pytest.mark.parametrize(
    "kv_dtype,q_dtype", [(None, torch.bfloat16), (FP8_E4M3, torch.float16)], ids=["bf16", "fp8"]
)
def test_attention_layers_replay_with_their_own_tensors(monkeypatch, kv_dtype, q_dtype):
    """Three layers of one mixed step (decode with split KV, prefill): the second and third
    replay the first one's launches and each matches the reference on its own data."""
    cache = LaunchCache()
    monkeypatch.setattr(attn.ops, "LAUNCHES", cache)
    batch = make_batch([1, 5, 20], [100, 40, 60], num_q_heads=6, num_kv_heads=2, head_size=64,
                       block_size=16, q_dtype=q_dtype, kv_dtype=kv_dtype, seed=41)  # fmt: skip
    num_rows = batch.pop("num_rows")
    ws = workspace(6, 64)
    step = paged_batch(batch)  # one per step, every layer's call shares it (as vLLM's backend)
    for i in range(LAYERS):
        layer = batch if i == 0 else _other_layer(batch, seed=i)
        options = dict(sinks=torch.linspace(-1.0, 1.0 + i, 6, device=DEVICE), softcap=15.0)
        expected = attn.paged_attention_reference(out=nan_out(layer["q"]), **layer, **options)
        out = nan_out(layer["q"])
        attn.attention_unchecked(
            layer["q"], layer["key_cache"], layer["value_cache"], out, step,
            attention_options(layer, **options), ws,
        )  # fmt: skip
        atol, rtol = TOL[q_dtype]
        assert_close(out[:num_rows], expected[:num_rows], atol=atol, rtol=rtol, what=f"layer {i}")
        assert torch.isnan(out[num_rows:]).all()
        assert cache.hits == i
    assert len(cache) == 1
    assert int(ws.counters.abs().sum()) == 0


def test_a_new_step_over_the_same_tensors_is_not_a_replay(monkeypatch):
    """A step's PagedBatch over the same metadata tensor objects as the last step's, its lengths
    written without a version bump (as a kernel or a CUDA graph writes them): the call records
    anew and writes its own balanced-split schedule. Replaying the last step's launches would
    read the last step's schedule, in which a former padding row has no piece (left NaN)."""
    cache = LaunchCache()
    monkeypatch.setattr(attn.ops, "LAUNCHES", cache)
    batch = make_batch([1, 1, 1], [1500, 40, 700], num_q_heads=8, num_kv_heads=2,
                       head_size=128, block_size=16, seed=43)  # fmt: skip
    num_rows = batch.pop("num_rows")
    ws = workspace(8, 128, max_splits=8, rows=16)
    q, kc, vc = batch["q"], batch["key_cache"], batch["value_cache"]
    options = attention_options(batch)
    cu, lens = batch["cu_seqlens_q"], batch["seq_lens"]
    full_cu, full_lens = cu.clone(), lens.clone()
    with torch.no_grad():  # .data writes: no version bump
        cu.data.copy_(torch.tensor([0, 1, 1, 2], dtype=torch.int32))
        lens.data.copy_(torch.tensor([1500, 0, 700], dtype=torch.int32))
    versions = (cu._version, lens._version)
    attn.attention_unchecked(q, kc, vc, nan_out(q), paged_batch(batch), options, ws)
    cu.data.copy_(full_cu)
    lens.data.copy_(full_lens)
    assert (cu._version, lens._version) == versions
    out = nan_out(q)
    attn.attention_unchecked(q, kc, vc, out, paged_batch(batch), options, ws)
    assert cache.hits == 0
    expected = attn.paged_attention_reference(out=nan_out(q), **batch)
    atol, rtol = TOL[q.dtype]
    assert_close(out[:num_rows], expected[:num_rows], atol=atol, rtol=rtol, what="step 2")


def test_attention_options_or_metadata_change_means_a_new_recording(monkeypatch):
    cache = LaunchCache()
    monkeypatch.setattr(attn.ops, "LAUNCHES", cache)
    batch = make_batch([1, 1], [30, 17], num_q_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, seed=42)  # fmt: skip
    num_rows = batch.pop("num_rows")
    runs = [
        dict(batch),
        dict(batch, scale=0.3),  # another option
        dict(batch, seq_lens=batch["seq_lens"].clone()),  # another step's metadata tensor
    ]
    for i, args in enumerate(runs):
        out = nan_out(args["q"])
        attn.paged_attention_unchecked(out=out, **args)
        expected = attn.paged_attention_reference(out=nan_out(args["q"]), **args)
        atol, rtol = TOL[torch.bfloat16]
        assert_close(out[:num_rows], expected[:num_rows], atol=atol, rtol=rtol, what=f"run {i}")
    assert (len(cache), cache.hits) == (3, 0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_E4M3])
def test_kv_write_layers_replay_with_their_own_tensors(monkeypatch, cache_dtype):
    cache = LaunchCache()
    monkeypatch.setattr(kvc.ops, "WRITE_LAUNCHES", cache)
    gen = torch.Generator().manual_seed(403)
    slots = torch.tensor([3, 40, 17, -1, 0, 63, 21], device=DEVICE)
    for i in range(LAYERS):
        _, key, value = make_inputs(gen, 7, 4, 2, 64, torch.bfloat16, "qkv")
        scales = {}
        if cache_dtype == FP8_E4M3:
            scales = dict(k_scale=torch.tensor([0.5 + i], device=DEVICE),
                          v_scale=torch.tensor([0.25 * (i + 1)], device=DEVICE))  # fmt: skip
        want = make_cache(4, 16, 2, 64, cache_dtype, "nhd")
        kvc.kv_cache_update_reference(key, value, *cache_views(want, "nhd", 64), slots, **scales)
        got = make_cache(4, 16, 2, 64, cache_dtype, "nhd")
        kvc.kv_cache_update_unchecked(key, value, *cache_views(got, "nhd", 64), slots, **scales)
        assert_bitwise_equal(got, want, f"layer {i}")
        assert written_elements(got) == 2 * 6 * 2 * 64
        assert cache.hits == i
    assert len(cache) == 1


# ----------------------------------------------------------------------------------------------
# What may and may not be recorded
# ----------------------------------------------------------------------------------------------


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=ok) + tl.load(y_ptr + offs, mask=ok), ok)


def _add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    _launch.launch(_add_kernel, (triton.cdiv(x.numel(), 16),), x, y, out, x.numel(), BLOCK=16)


def _vectors(n: int = 40) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(n, device=DEVICE) for _ in range(3))


def test_replay_substitutes_slots_and_keeps_fixed_tensors():
    cache = LaunchCache()
    x, y, out = _vectors()
    with cache.record("k", slots=(x, out), fixed=(y,)):
        _add(x, y, out)
    torch.testing.assert_close(out, x + y)
    x2, _, out2 = _vectors()
    assert cache.replay("k", (x2, out2))
    torch.testing.assert_close(out2, x2 + y)
    assert not cache.replay("other key", (x2, out2))
    assert cache.hits == 1


@pytest.mark.parametrize(
    "case", ["derived slot", "unlisted tensor", "one tensor in two slots", "no launch"]
)
def test_unsafe_recordings_are_not_kept(case):
    """A tensor argument that is neither a slot nor fixed could be another layer's (a view of a
    slot) or change between calls: such a recording is dropped, and the call launched as is."""
    cache = LaunchCache()
    x, y, out = _vectors()
    if case == "derived slot":
        with cache.record("k", slots=(x, out), fixed=(y,)):
            _add(x[:20], y[:20], out[:20])
    elif case == "unlisted tensor":
        with cache.record("k", slots=(x, out), fixed=()):
            _add(x, y, out)
    elif case == "one tensor in two slots":
        with cache.record("k", slots=(x, x, out), fixed=(y,)):
            _add(x, y, out)
    else:
        with cache.record("k", slots=(x, out), fixed=(y,)):
            pass
    assert len(cache) == 0
    assert not cache.replay("k", (x, out))


def test_nested_recording_belongs_to_the_outer_one():
    outer, inner = LaunchCache(), LaunchCache()
    x, y, out = _vectors()
    with outer.record("k", slots=(x, out), fixed=(y,)):
        with inner.record("k", slots=(x, out), fixed=(y,)):
            _add(x, y, out)
    assert (len(outer), len(inner)) == (1, 0)


def test_an_exception_records_nothing():
    cache = LaunchCache()
    x, y, out = _vectors()
    with pytest.raises(RuntimeError), cache.record("k", slots=(x, out), fixed=(y,)):
        _add(x, y, out)
        raise RuntimeError("boom")
    assert len(cache) == 0
    assert _launch.current_recording() is None


def test_full_cache_starts_over():
    cache = LaunchCache(max_entries=2)
    x, y, out = _vectors()
    for key in ("a", "b", "c"):
        with cache.record(key, slots=(x, out), fixed=(y,)):
            _add(x, y, out)
    assert len(cache) == 1
    assert cache.replay("c", (x, out)) and not cache.replay("a", (x, out))


class _CompiledStandIn:
    """The parts of a compiled Triton kernel a direct replay uses; records its launches."""

    function = "function"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.calls.append(((gx, gy, gz), stream, args))


def test_direct_replay_passes_addresses_and_checks_alignment(monkeypatch):
    """On a GPU a recording keeps the compiled kernel and its full argument list: slots become
    the new tensors' addresses, fixed tensors their recorded addresses (no driver lookups).
    A slot address off the 16-byte alignment the kernel was compiled for launches normally."""
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 1000 + device)
    kernel = _CompiledStandIn()
    cache = LaunchCache()
    x, y, out = (torch.zeros(64) for _ in range(3))
    with cache.record("k", slots=(x, out, None), fixed=(y,)):
        _launch.current_recording().add_direct(kernel, (5, 2), [x, y, out, 7, None])
    x2, out2 = torch.zeros(64), torch.zeros(64)
    assert cache.replay("k", (x2, out2, None))
    assert kernel.calls == [
        ((5, 2, 1), 1000, (x2.data_ptr(), y.data_ptr(), out2.data_ptr(), 7, None))
    ]
    misaligned = torch.zeros(65)[1:]  # 4 bytes past an aligned allocation
    assert misaligned.data_ptr() % 16
    assert not cache.replay("k", (misaligned, out2, None))
    assert len(kernel.calls) == 1


def test_launch_hook_turns_recording_and_replay_off(monkeypatch):
    """A profiler's launch hook must see every launch: nothing is replayed around it."""
    cache = LaunchCache()
    x, y, out = _vectors()
    with cache.record("k", slots=(x, out), fixed=(y,)):
        _add(x, y, out)
    monkeypatch.setattr(_launch, "_hooked", lambda: True)
    assert not cache.replay("k", (x, out))


def test_another_threads_launch_is_not_recorded():
    """The recording belongs to the thread that makes it: a launch from another thread in the
    meantime goes to no recording (it would be replayed with this call's tensors)."""
    import threading

    cache = LaunchCache()
    x, y, out = _vectors()
    other = _vectors()
    with cache.record("k", slots=(x, out), fixed=(y,)):
        worker = threading.Thread(target=_add, args=other)
        worker.start()
        worker.join()
        _add(x, y, out)
    launches, *_ = cache._entries["k"]
    assert len(launches) == 1
    torch.testing.assert_close(other[2], other[0] + other[1])

"""Every kernel entry point allocates nothing during a call (CUDA-graph safety, and no
caching-allocator churn on vLLM's eager path): its outputs and scratch are the caller's
tensors and the workspace.

On a GPU the caching allocator's counters must not move across a call (after a first call has
compiled the kernels). On the CPU, where the interpreter allocates for its own launches, the
host code around the launches is checked: with the launches stubbed out, every torch operation
the entry point runs must be a view or write into an existing tensor (a dispatch-mode trace).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fuselane.kernels import _launch, index_checks
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kvc
from fuselane.kernels import sampling as smp
from tests.device import DEVICE
from tests.kernels.test_attention import make_batch, nan_out, paged_batch, plan_for, workspace
from tests.kernels.test_kv_cache import cache_views, make_cache, make_inputs, make_slots


class _Allocations(TorchDispatchMode):
    """Records the torch operations that produce a new tensor (neither a view nor in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not (func.is_view or writes):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _assert_allocates_nothing(call: Callable[[], object], monkeypatch) -> None:
    # The serving path: FUSELANE_CHECK_INDICES (on in the tests) allocates for its checks.
    monkeypatch.setattr(index_checks, "_enabled", False)
    call()  # compiles (GPU) and records whatever a first call records
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        call()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        return
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: None)
    for module in _launch_users():
        monkeypatch.setattr(module, "launch", lambda *a, **k: None)
    # A replay under the interpreter goes through `fn[grid]`, which copies its arguments: the
    # traced call records instead (the replay's own host code is the GPU branch's to check).
    attn.LAUNCHES.clear()
    kvc.WRITE_LAUNCHES.clear()
    with _Allocations() as trace:
        call()
    assert not trace.seen, f"the entry point allocated: {trace.seen}"


def _launch_users():
    """The modules that bound `launch` at import (their launchers call it by that name)."""
    from fuselane.kernels.attention import balance, decode, prefill
    from fuselane.kernels.kv_cache import launch as kv_launch
    from fuselane.kernels.sampling import ops as sampling_ops

    return (balance, decode, prefill, kv_launch, sampling_ops)


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([1, 1, 1], [40, 7, 300]), ([16, 1], [16, 90]), ([33], [33])],
    ids=["decode", "mixed", "prefill"],
)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_attention_allocates_nothing(monkeypatch, q_lens, seq_lens, checked):
    batch = make_batch(q_lens, seq_lens, num_q_heads=8, num_kv_heads=2, head_size=64,
                       block_size=16, seed=3)  # fmt: skip
    ws = workspace(8, 64)
    out = nan_out(batch["q"])
    pb = paged_batch(batch)
    options = attn.AttentionOptions(batch["scale"])
    entry = attn.attention if checked else attn.attention_unchecked
    attn.LAUNCHES.clear()

    def call():
        entry(batch["q"], batch["key_cache"], batch["value_cache"], out, pb, options, ws)

    _assert_allocates_nothing(call, monkeypatch)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_new_steps_balanced_schedule_allocates_nothing(monkeypatch, checked):
    """Each call a new step (a new PagedBatch), so each writes its balanced split's schedule:
    into a slot of the workspace, not a new tensor."""
    batch = make_batch([1, 1, 1], [40, 7, 300], num_q_heads=8, num_kv_heads=2, head_size=64,
                       block_size=16, seed=3)  # fmt: skip
    ws = workspace(8, 64)
    assert plan_for(batch, ws).decode.split_budget > 0, "the rule should balance this batch"
    out = nan_out(batch["q"])
    options = attn.AttentionOptions(batch["scale"])
    entry = attn.attention if checked else attn.attention_unchecked
    attn.LAUNCHES.clear()

    def call():
        entry(batch["q"], batch["key_cache"], batch["value_cache"], out, paged_batch(batch),
              options, ws)  # fmt: skip

    _assert_allocates_nothing(call, monkeypatch)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_kv_writes_allocate_nothing(monkeypatch, fp8):
    gen = torch.Generator().manual_seed(11)
    query, key, value = make_inputs(gen, 20, 4, 2, 64, torch.bfloat16, "qkv")
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    base = make_cache(4, 16, 2, 64, cache_dtype, "nhd")
    kc, vc = cache_views(base, "nhd", 64)
    slots = make_slots(gen, 20, 64, 16, pad_every=5)
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.08], device=DEVICE))
    write = kvc.KVWrite(key, value, kc, vc, slots, *(scales if fp8 else (None, None)))
    positions = torch.arange(20, device=DEVICE)
    cos_sin = torch.randn(64, 64, generator=gen).to(DEVICE)
    rotary = kvc.Rotary(positions, query, cos_sin, True)
    _assert_allocates_nothing(lambda: kvc.kv_write(write), monkeypatch)
    kvc.WRITE_LAUNCHES.clear()
    _assert_allocates_nothing(lambda: kvc.kv_write_unchecked(write), monkeypatch)
    _assert_allocates_nothing(lambda: kvc.rope_kv_write(rotary, write), monkeypatch)


@pytest.mark.parametrize("num_logprobs", [None, 0, 5])
def test_fused_sample_with_a_workspace_allocates_nothing(monkeypatch, num_logprobs):
    gen = torch.Generator().manual_seed(5)
    B, V = 4, 1000
    logits = torch.randn(B, V, generator=gen).to(DEVICE)
    params = smp.SamplingParamsTensors(
        temperature=torch.full((B,), 0.8, device=DEVICE),
        top_k=torch.full((B,), 50, dtype=torch.int32, device=DEVICE),
        top_p=torch.full((B,), 0.9, device=DEVICE),
    )
    ws = smp.SamplingWorkspace.allocate(B, V, DEVICE, max_logprobs=8, arith="torch")

    def call():
        smp.fused_sample(logits, params, workspace=ws, num_logprobs=num_logprobs)

    _assert_allocates_nothing(call, monkeypatch)

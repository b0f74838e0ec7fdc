"""Host time per layer on vLLM's eager attention path: fuselane against its peers, same process.

vLLM runs attention outside its CUDA graphs for every batch its full graphs do not cover
(prefill and mixed steps under FULL_AND_PIECEWISE, and every step past the largest captured
size). There each layer's attention and KV write are launched from Python, and once the host
takes longer per layer than the GPU does, host time is step time. This measures, for
Llama-3-8B's per-layer shapes (Hq=32, Hkv=8, D=128, page 16, bf16) and the batches of the
end-to-end workloads:

- host_us: host microseconds per call, timed while a GPU sleep queued first keeps the device
  busy, so the host never waits for it; `waited_for_gpu` says a call blocked anyway (a hidden
  host-device sync, which would serialize host and GPU time on every layer);
- gpu_us: device microseconds per call (CUDA-graph replay, as the other kernel benchmarks).

Rows: fuselane's attention and its KV write (checked; unchecked as a step's first layer calls
them, launched and recorded; unchecked as the later layers do, replaying that recording), their
host-side parts (argument checks, launch plan), vLLM's unified Triton attention and its Triton
KV write, FlashInfer's paged prefill `run` (its per-step `plan` reported separately: vLLM calls
it once per step, not per layer).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import attention_workload as ba
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.attention_timing import Peers
from fuselane.benchmarks.kernels.peers import RESHAPE_AND_CACHE_FLASH, import_peer
from fuselane.kernels import _launch
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kvk

CALLS = 100  # per host-time sample; a few hundred launches stay within the launch queue
SAMPLES = 7
# Per-layer batches of the end-to-end workloads (benchmarks/e2e/run_e2e.py): the online run's
# steps (512-token prompts arriving while ~13 requests decode at ~600 tokens), and a prefill
# step of the 8192-token workload (two prompts under a 16384-token step budget).
CASES: dict[str, tuple[list[int], list[int]]] = {
    "decode B=16 ctx=640": ([1] * 16, [640] * 16),
    "prefill 1x512": ([512], [512]),
    "mixed 512 + 13 decode ctx=640": ([512] + [1] * 13, [512] + [640] * 13),
    "prefill 2x8192": ([8192] * 2, [8192] * 2),
}


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per millisecond (measured)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def host_us(fn: Callable[[], object], cycles_per_ms: float) -> tuple[float, bool]:
    """(median host microseconds per call, whether any sample waited for the GPU)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples, waited = [], False
    for _ in range(SAMPLES):
        # Size the sleep to outlast the loop by far: a loop as long as the sleep had to wait.
        guess_ms = 20.0 + CALLS * (samples[-1] if samples else 2000.0) * 1e-3 * 4
        torch.cuda._sleep(int(guess_ms * cycles_per_ms))
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        waited = waited or elapsed_ms > 0.8 * guess_ms
        samples.append(elapsed_ms * 1e3 / CALLS)
    return statistics.median(samples), waited


def host_only_us(fn: Callable[[], object], reps: int = 2000) -> float:
    """Microseconds per call of host-only work (no launch)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def first_layer(fn: Callable[[], object], cache: _launch.LaunchCache) -> Callable[[], object]:
    """`fn` as a step's first layer calls it: nothing recorded yet, so it launches and records."""

    def call():
        cache.clear()
        fn()

    return call


def bench_attention_case(case: str, p, workspace, peers, add, add_part) -> None:
    out = torch.empty_like(p.q)
    a = p.args()

    def fuselane():
        attn.paged_attention(out=out, workspace=workspace, **a)

    add(case, "fuselane", fuselane)

    batch, options = p.bundles()

    def unchecked(into: torch.Tensor = out):  # as vLLM's backend calls it, layer by layer
        attn.attention_unchecked(p.q, p.key_cache, p.value_cache, into, batch, options, workspace)

    add(case, "fuselane (unchecked, a step's first layer)", first_layer(unchecked, attn.LAUNCHES))
    add(case, "fuselane (unchecked, later layers: replayed)", unchecked)
    attn.LAUNCHES.clear()
    # the same launches through Triton's `kernel[grid]`: what the direct launch saves
    _launch.DIRECT = False
    try:
        add_part(case, "fuselane:triton-launch", fuselane, launches=True)
    finally:
        _launch.DIRECT = True
    # the directly launched kernels compute what the reference says (output poisoned first)
    expected = ba.Expected(p, prefill=max(p.lens) > 4096)  # O(S^2) reference
    out.fill_(float("nan"))
    fuselane()
    ok, detail = expected.check(out)
    peers.note(
        f"{case}: fuselane output after direct launches {'PASS' if ok else 'FAIL'} ({detail})"
    )
    # a replay writes into its own output: record with one, replay into another (poisoned)
    attn.LAUNCHES.clear()
    unchecked()
    replayed = torch.full_like(out, float("nan"))
    hits = attn.LAUNCHES.hits
    unchecked(replayed)
    ok, detail = expected.check(replayed)
    ok = ok and attn.LAUNCHES.hits == hits + 1
    peers.note(
        f"{case}: fuselane output of a replayed launch {'PASS' if ok else 'FAIL'} ({detail})"
    )
    check_args = (p.q, p.key_cache, p.value_cache, out, batch, options)
    add_part(case, "fuselane:checks", lambda: attn.checks._check_args(*check_args))
    plan_args = dict(
        num_seqs=len(p.lens),
        num_q_heads=ba.HQ,
        num_kv_heads=ba.HKV,
        head_size=ba.D,
        max_query_len=max(p.q_lens),
        sms=attn.sm_count(p.q.device),
        workspace=workspace,
        warp_specialized=attn.warp_specialized_ok(p.q, p.key_cache, p.value_cache),
    )
    add_part(case, "fuselane:plan", lambda: attn.plan_launch(**plan_args))
    if peers.vllm is not None:
        add(case, "vllm-triton-unified", peers.vllm_fn(p, torch.empty_like(p.q)))
    if peers.flashinfer is None or max(p.q_lens) == 1:
        return
    try:
        wrapper = peers.flashinfer.BatchPrefillWithPagedKVCacheWrapper(peers.fi_workspace, "NHD")

        def plan():
            wrapper.plan(
                p.cu,
                p.kv_indptr,
                p.kv_indices,
                p.kv_last_page_len,
                ba.HQ,
                ba.HKV,
                ba.D,
                ba.PAGE,
                causal=True,
                sm_scale=ba.SCALE,
                q_data_type=ba.DTYPE,
                kv_data_type=ba.DTYPE,
            )

        plan()
        o = torch.empty_like(p.q)
        add(case, "flashinfer", lambda: wrapper.run(p.q, p.kv, out=o))
        # plan copies its host-built indices to the device and waits for them: timed as host
        # work (GPU idle), since a busy GPU would make every call wait for it
        add_part(case, "flashinfer:plan", plan)
    except Exception as e:  # noqa: BLE001
        peers.note(f"{case} flashinfer failed: {e!r}")


def new_tokens(p, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key, value, slots) of the step's new tokens: random K/V for random free slots."""
    tokens = sum(p.q_lens)
    key = torch.randn(tokens, ba.HKV, ba.D, device="cuda", dtype=ba.DTYPE)
    return key, torch.randn_like(key), torch.randperm(num_slots, device="cuda")[:tokens]


def bench_write_case(case: str, p, num_slots: int, vllm_write, add, add_part, note) -> None:
    """The step's new tokens written to random free slots of the pool."""
    key, value, slots = new_tokens(p, num_slots)
    kc, vc = p.key_cache, p.value_cache

    def fuselane():
        kvk.kv_cache_update(key, value, kc, vc, slots)

    add(case, "fuselane", fuselane)
    _launch.DIRECT = False
    try:
        add_part(case, "fuselane:triton-launch", fuselane, launches=True)
    finally:
        _launch.DIRECT = True
    # the direct launch wrote what the reference writes (fresh caches, poisoned)
    got_k, got_v = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    want_k, want_v = got_k.clone(), got_v.clone()
    kvk.kv_cache_update(key, value, got_k, got_v, slots)
    kvk.kv_cache_update_reference(key, value, want_k, want_v, slots)
    same = torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0)) and torch.equal(
        got_v.nan_to_num(7.0), want_v.nan_to_num(7.0)
    )
    note(f"{case}: fuselane write after direct launches {'PASS' if same else 'FAIL'}")

    def unchecked():  # as vLLM's backend calls it: one KVWrite per layer call
        kvk.kv_write_unchecked(kvk.KVWrite(key, value, kc, vc, slots))

    recorded = first_layer(unchecked, kvk.WRITE_LAUNCHES)
    add(case, "fuselane (unchecked, a step's first layer)", recorded)
    add(case, "fuselane (unchecked, later layers: replayed)", unchecked)
    # a replay writes into its own caches: recorded on one pair, replayed on fresh ones
    kvk.WRITE_LAUNCHES.clear()
    kvk.kv_write_unchecked(kvk.KVWrite(key, value, want_k.clone(), want_v.clone(), slots))
    got_k.fill_(float("nan"))
    got_v.fill_(float("nan"))
    hits = kvk.WRITE_LAUNCHES.hits
    kvk.kv_write_unchecked(kvk.KVWrite(key, value, got_k, got_v, slots))
    same = kvk.WRITE_LAUNCHES.hits == hits + 1 and all(
        torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))
        for g, w in ((got_k, want_k), (got_v, want_v))
    )
    note(f"{case}: fuselane write of a replayed launch {'PASS' if same else 'FAIL'}")
    if vllm_write is not None:
        one = torch.ones((), dtype=torch.float32, device="cuda")
        add(case, "vllm-triton", lambda: vllm_write(key, value, kc, vc, slots, "auto", one, one))


def profile_case(case: str, p, workspace, num_slots: int, cycles_per_ms: float, out_dir: Path):
    """`host_profile` of the attention call and the KV write of one case, as the backend makes
    them (unchecked), written to out_dir/host_profile-<case>.txt."""
    out = torch.empty_like(p.q)
    key, value, slots = new_tokens(p, num_slots)
    batch, options = p.bundles()

    def attention():
        attn.attention_unchecked(p.q, p.key_cache, p.value_cache, out, batch, options, workspace)

    def write():
        kvk.kv_write_unchecked(kvk.KVWrite(key, value, p.key_cache, p.value_cache, slots))

    text = [
        "attention (attention_unchecked), later layers: replayed",
        host_profile(attention, cycles_per_ms),
        "attention (attention_unchecked), a step's first layer: launched and recorded",
        host_profile(first_layer(attention, attn.LAUNCHES), cycles_per_ms),
        "kv write (kv_cache_update_unchecked), later layers: replayed",
        host_profile(write, cycles_per_ms),
        "kv write (kv_cache_update_unchecked), a step's first layer: launched and recorded",
        host_profile(first_layer(write, kvk.WRITE_LAUNCHES), cycles_per_ms),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"host_profile-{re.sub(r'[^A-Za-z0-9_.-]+', '_', case)}.txt"
    path.write_text("\n".join(text))
    print(f"wrote {path}", flush=True)


def host_profile(fn: Callable[[], object], cycles_per_ms: float, calls: int = 2000) -> str:
    """cProfile of `calls` calls of `fn` while the GPU is kept busy (as `host_us`): where the
    host time of one call goes, function by function (top 30 by own time)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    done = 0
    while done < calls:
        torch.cuda._sleep(int(100.0 * cycles_per_ms))  # the GPU stays busy for the next batch
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        done += CALLS
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return f"{done} calls\n{buf.getvalue()}"


def main() -> int:
    parser = family_script.script_parser(__doc__)
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="also write a cProfile of the unchecked attention call and the KV write per case",
    )
    args = parser.parse_args()
    if family_script.no_cuda("bench_host_overhead"):
        return 2
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    report = harness.Report("host_overhead")
    peers = Peers(report)
    if args.no_flashinfer:
        peers.flashinfer = None
    vllm_write = import_peer(RESHAPE_AND_CACHE_FLASH, peers.note)
    cycles_per_ms = sleep_cycles_per_ms()
    print(f"device: {report.info}; GPU sleep {cycles_per_ms:.0f} cycles/ms", flush=True)
    workspace = attn.AttentionWorkspace.allocate(
        512, ba.HQ, ba.D, torch.device("cuda"), max_splits=attn.DEFAULT_MAX_SPLITS
    )
    pool = ba.make_pool(4096, ba.PAGE, ba.HKV, ba.D, ba.DTYPE)

    def add(case: str, impl: str, fn: Callable[[], object]) -> None:
        """A launch: host time (GPU kept busy) and GPU time."""
        h, waited = host_us(fn, cycles_per_ms)
        gpu_ms = harness.time_graph(fn)
        report.add(
            harness.Row(
                "host", case, impl, gpu_ms, extra=dict(host_us=round(h, 2), waited_for_gpu=waited)
            )
        )
        print(
            f"{case:34s} {impl:22s} host {h:8.2f} us  gpu {gpu_ms * 1e3:9.2f} us"
            f"{'  WAITED FOR THE GPU' if waited else ''}",
            flush=True,
        )

    def add_part(case: str, impl: str, fn: Callable[[], object], launches: bool = False) -> None:
        """Host-only work (its row's time is host time; no ratio is taken)."""
        if launches:
            h, waited = host_us(fn, cycles_per_ms)
        else:
            h, waited = host_only_us(fn), False
        report.add(
            harness.Row(
                "host_parts",
                case,
                impl,
                h * 1e-3,
                extra=dict(host_us=round(h, 2), waited_for_gpu=waited),
            )
        )
        print(
            f"{case:34s} {impl:22s} host {h:8.2f} us{'  WAITED FOR THE GPU' if waited else ''}",
            flush=True,
        )

    for case, (q_lens, lens) in CASES.items():
        p = ba.make_problem(q_lens, lens, gen, kv=pool)
        bench_attention_case(case, p, workspace, peers, add, add_part)
        bench_write_case(
            f"{case} kv write", p, pool.shape[0] * ba.PAGE, vllm_write, add, add_part, peers.note
        )
        if args.cprofile:
            profile_case(case, p, workspace, pool.shape[0] * ba.PAGE, cycles_per_ms, args.out)
    for out_dir in (args.out, None):
        print(f"wrote {report.write(out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up compilation: how long the serving warm-ups take, and that serving then compiles nothing.

vLLM's backend compiles every attention and KV-write variant its launch rules can choose on a
layer's first call, and the sampler hook the common sampling variants on vLLM's dummy sampler
run (plugin/warmup.py), all inside `kernels._launch.compile_only` (parallel compiles). This
times those warm-ups from an empty Triton cache (a fresh TRITON_CACHE_DIR), then launches
batches of every launch configuration and checks that none of them compiled (Triton's
per-function caches do not grow) and what each first launch cost.

Shapes: Llama-3-8B (Hq=32, Hkv=8, D=128, page 16, bf16, vocab 128256), max_num_seqs 256.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fuselane-startup-triton-")
if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.kernels import _launch
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kvk
from fuselane.kernels import sampling as smp
from fuselane.kernels.attention import decode as attention_decode
from fuselane.kernels.attention import prefill as attention_prefill
from fuselane.plugin.sampler_common import V1_WARM_PARAM_SETS

HQ, HKV, D, PAGE, VOCAB, MAX_SEQS = 32, 8, 128, 16, 128256, 256
WORKERS = 8
# The sampler hook's V1 parameter sets, as its start-up compiles them.
PARAM_SETS = V1_WARM_PARAM_SETS
KERNELS = {
    "decode": attention_decode._decode_kernel,
    "reduce": attention_decode._splitkv_reduce_kernel,
    "prefill": attention_prefill._prefill_kernel,
    "kv_write": kvk.write._kv_cache_update_kernel,
    "sample_chunk": smp.chunk._sample_chunk_kernel,
    "sample_combine": smp.combine._sample_combine_kernel,
}


def compiled_counts() -> dict[str, int]:
    dev = torch.cuda.current_device()
    return {
        k: len(fn.device_caches[dev][0]) if dev in fn.device_caches else 0
        for k, fn in KERNELS.items()
    }


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def serving_step(q_lens: list[int], key_cache, value_cache, block_table, workspace) -> float:
    """Milliseconds of the first KV write + attention call on a batch of these query lengths."""
    dev = key_cache.device
    seqs, rows = len(q_lens), sum(q_lens)
    q = torch.randn(rows, HQ, D, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    lens = torch.tensor([max(n, 600) for n in q_lens], dtype=torch.int32, device=dev)
    slots = torch.randperm(key_cache.shape[0] * PAGE, device=dev)[:rows]
    k = torch.randn(rows, HKV, D, dtype=torch.bfloat16, device=dev)

    def step():
        kvk.kv_cache_update(k, k, key_cache, value_cache, slots)
        attn.paged_attention(
            q,
            key_cache,
            value_cache,
            out,
            cu,
            lens,
            block_table[:seqs],
            max_query_len=max(q_lens),
            max_seq_len=int(lens.max()),
            scale=D**-0.5,
            workspace=workspace,
        )

    return round(timed(step) * 1e3, 2)


def main() -> int:
    args = family_script.script_parser(__doc__).parse_args()
    if family_script.no_cuda("bench_startup"):
        return 2
    dev = torch.device("cuda")
    info = harness.device_info()
    cache = torch.zeros(2048, PAGE, HKV, 2 * D, dtype=torch.bfloat16, device=dev)
    key_cache, value_cache = cache.split(D, dim=-1)
    block_table = torch.zeros(MAX_SEQS, 64, dtype=torch.int32, device=dev)
    workspace = attn.AttentionWorkspace.allocate(
        512, HQ, D, dev, max_splits=attn.DEFAULT_MAX_SPLITS
    )
    sws = smp.SamplingWorkspace.allocate(MAX_SEQS, VOCAB, dev, max_logprobs=smp.MAX_LOGPROBS)
    result: dict[str, object] = {"benchmark": "startup", **info, "workers": WORKERS}

    def attention_warm():
        with _launch.compile_only(WORKERS):
            n = attn.warm_up(
                key_cache,
                value_cache,
                block_table[:1],
                num_q_heads=HQ,
                q_dtype=torch.bfloat16,
                options=attn.AttentionOptions(scale=D**-0.5),
                workspace=workspace,
            )
            n += kvk.warm_up_write(key_cache, value_cache, key_dtype=torch.bfloat16)
        result["attention_kv_launch_configs"] = n

    def sampling_warm():
        with _launch.compile_only(WORKERS):
            result["sampling_calls"] = smp.warm_up(
                smp.SamplingParamsTensors(),
                sws,
                torch.float32,
                param_sets=PARAM_SETS,
                num_logprobs=None,
                logits_writable=True,
            )

    result["attention_kv_warm_up_s"] = round(timed(attention_warm), 2)
    result["sampling_warm_up_s"] = round(timed(sampling_warm), 2)
    before = compiled_counts()
    result["compiled_variants"] = before
    print(json.dumps(result), flush=True)

    # Serving-like launches of every configuration: nothing may compile now.
    first_ms: dict[str, float] = {}
    gen = torch.Generator(device=dev).manual_seed(0)
    for q_lens in (
        [1],
        [1] * 8,
        [1] * 64,
        [1] * 256,
        [4] * 16,
        [512],
        [512] + [1] * 13,
        [2048, 2048],
        [8] * 100,
    ):
        label = f"attention+kv q_lens={q_lens[:3]}{'...' if len(q_lens) > 3 else ''} x{len(q_lens)}"
        first_ms[label] = serving_step(q_lens, key_cache, value_cache, block_table, workspace)
    for b in (1, 4, 5, 32, 33, 256):
        logits = torch.randn(b, VOCAB, generator=gen, device=dev)
        for fields in PARAM_SETS:
            p = smp.SamplingParamsTensors()
            for name in fields:
                dt = torch.int32 if name == "top_k" else torch.float32
                setattr(p, name, torch.full((b,), smp.ops._WARM_VALUES[name], dtype=dt, device=dev))
            ms = timed(lambda: smp.fused_sample(logits, p, workspace=sws, num_logprobs=None)) * 1e3  # noqa: B023
            first_ms[f"sampling B={b} {'+'.join(fields)}"] = round(ms, 2)
    after = compiled_counts()
    result["first_launch_ms"] = first_ms
    result["compiled_while_serving"] = {k: after[k] - before[k] for k in after}
    result["ok"] = all(v == 0 for v in result["compiled_while_serving"].values())
    print(json.dumps(result, indent=1))
    stamp = time.strftime("%Y-%m-%d")
    name = str(info["device"]).replace("NVIDIA ", "").replace(" ", "-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"startup-{name}-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

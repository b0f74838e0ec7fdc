"""`fuselane bench kernels`, attention: decode (uniform and ragged contexts) and prefill, each
over bf16 and fp8 KV caches, and mixed batches of each model shape.

Inputs and checks are bench_attention's (attention_workload.py: `make_problem` over one random
KV pool per model; `Expected`: the reference's output and its tolerance), with the model's head
counts, head size, sliding window, soft cap and scale 1/sqrt(D). Every implementation's output
is compared with the reference on the timed inputs; fuselane is timed only if it matches.

Peers: vLLM's `unified_attention` (TRITON_ATTN's kernel, its split scratch sized as
triton_attn.py sizes it), FlashInfer's paged decode (tensor cores) and prefill wrappers
(`plan()` outside the timed call), torch SDPA's flash and cuDNN backends on dense,
GQA-expanded tensors for bf16 prefill (where SDPA can express the model: no soft cap, no window
shorter than the sequence; over an fp8 cache SDPA would read a bf16 copy, so it is no peer
there).

Where a decode batch could run on either of fuselane's decode kernels (Hopper's warp-specialized
one suits it, `attn.decode_ws_config`), the one the launch rule did not pick is timed too, as
`fuselane-ws` or `fuselane-triton`: the grid is also the measurement behind that rule.

Counted: decode moves the K and V rows it reads (the last `window` keys at most), q and out;
prefill and mixed do 4 * Hq * D FLOPs per visible (query, key) pair (QK^T and PV).
"""

from __future__ import annotations

import functools
import math
import statistics

import torch

from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels.attention_timing import VllmScratch, vllm_attention
from fuselane.benchmarks.kernels.grid import (
    FP8_SECTIONS,
    PAGE,
    PREFILL_SECTIONS,
    Case,
    ModelShape,
    build_grid,
)
from fuselane.benchmarks.kernels.impls import Check, Context, Impl, Prepared, generator
from fuselane.kernels import attention as attn

DTYPE = torch.bfloat16


def visible_pairs(q_len: int, seq_len: int, window: int | None) -> int:
    """Causal (query, key) pairs of q_len queries ending at key seq_len: the query at position p
    sees min(p + 1, window) keys."""
    lo, hi = seq_len - q_len + 1, seq_len  # keys seen by the first and the last query

    def tri(n: int) -> int:
        return n * (n + 1) // 2

    if window is None or hi <= window:
        return tri(hi) - tri(lo - 1)
    if lo > window:
        return q_len * window
    return tri(window) - tri(lo - 1) + (hi - window) * window


def case_lens(case: Case) -> tuple[list[int], list[int]]:
    """Query rows and context length of every sequence of an attention case."""
    size = case.params
    if case.section in PREFILL_SECTIONS:
        return [size["seq_len"]], [size["seq_len"]]
    if case.section == "mixed":
        rows = size["decodes"] + size["chunks"]
        q_lens = [1] * size["decodes"] + [size["chunk_len"]] * size["chunks"]
        return q_lens, [size["context"]] * rows
    lens = case.contexts or []
    return [1] * len(lens), lens


def case_pages(case: Case) -> int:
    return sum(math.ceil(n / PAGE) for n in case_lens(case)[1])


@functools.cache
def pool_pages(grid: str) -> int:
    """KV pages for the largest attention case of a grid (one pool serves a model's cases)."""
    return max(case_pages(c) for c in build_grid(("attention",), grid=grid)) + 64


def kv_dtype(case: Case) -> torch.dtype:
    return aw.FP8 if case.section in FP8_SECTIONS else DTYPE


def kv_pool(ctx: Context, m: ModelShape, dtype: torch.dtype, pages: int) -> torch.Tensor:
    """The model's random KV pool in `dtype` (one pool kept at a time), at least `pages` long."""
    key = f"kv_pool:{m.num_kv_heads}x{m.head_size}" + ("" if dtype == DTYPE else " fp8")
    old = ctx.cache.get(key)
    if old is not None and old.shape[0] < pages:  # a case past the grid's (tests): grow it
        del ctx.cache[key]
    size = max(pages, pool_pages(ctx.grid))
    return ctx.keep(key, lambda: aw.make_pool(size, PAGE, m.num_kv_heads, m.head_size, dtype))


def warm_key(kind: str, m: ModelShape, kv: torch.dtype = DTYPE) -> tuple[str, dict[str, object]]:
    """FlashInfer's JIT module for decode or prefill of this shape and KV cache dtype: (key,
    warm-up spec)."""
    key = f"{kind} D={m.head_size} window={m.sliding_window} softcap={m.softcap:g}"
    spec: dict[str, object] = {
        "kind": kind,
        "num_q_heads": m.num_q_heads,
        "num_kv_heads": m.num_kv_heads,
        "head_size": m.head_size,
        "window_left": -1 if m.sliding_window is None else m.sliding_window - 1,
        "softcap": m.softcap,
    }
    if kv == aw.FP8:
        key += " kv=fp8"
        spec["kv_dtype"] = "float8_e4m3fn"
    return key, spec


def _fi_kind(case: Case) -> str:
    return "decode" if case.section.startswith("decode") else "prefill"


def warmups(case: Case) -> dict[str, dict[str, object]]:
    key, spec = warm_key(_fi_kind(case), case.shape, kv_dtype(case))
    return {key: spec}


def prepare(ctx: Context, case: Case) -> Prepared:
    m = case.shape
    q_lens, lens = case_lens(case)
    decode = case.section.startswith("decode")
    hq, d = m.num_q_heads, m.head_size
    cache_dtype = kv_dtype(case)
    pool = kv_pool(ctx, m, cache_dtype, case_pages(case))
    ws = ctx.keep(
        f"attn_workspace:{hq}x{d}",
        lambda: attn.AttentionWorkspace.allocate(
            aw.WS_ROWS, hq, d, ctx.device, max_splits=aw.WS_SPLITS
        ),
    )
    p = aw.make_problem(q_lens, lens, generator(ctx.device, case.seed), kv=pool, hq=hq)
    opts = {"scale": d**-0.5, "sliding_window": m.sliding_window, "softcap": m.softcap}
    expected = aw.Expected(p, case.section in PREFILL_SECTIONS, **opts)
    extra: dict[str, object] = {"window": m.sliding_window, "softcap": m.softcap}
    if cache_dtype != DTYPE:
        extra["cache_dtype"] = str(cache_dtype)[6:]
    if case.dist is not None:  # what was drawn, so a reader can rebuild the batch
        extra.update(
            ctx_dist=case.dist.label,
            ctx_seed=case.dist.seed(len(lens)),
            ctx_min=min(lens),
            ctx_median=statistics.median(lens),
            ctx_max=max(lens),
            ctx_sum=sum(lens),
            contexts=lens,
        )
    prep = Prepared(impls=[], extra=extra)
    if decode:
        prep.nbytes = aw.decode_bytes(p, m.sliding_window)
    else:
        pairs = sum(
            visible_pairs(q, n, m.sliding_window) for q, n in zip(q_lens, lens, strict=True)
        )
        prep.flops = 4.0 * hq * d * pairs

    def fuselane():
        # As vLLM's backend calls it: one PagedBatch per step, which every layer's call shares
        # (a balanced split's schedule is written by the step's first call, read by the rest).
        out = aw.nan_like(p.q)
        batch, options = p.bundles(**opts)
        q, kc, vc = p.q, p.key_cache, p.value_cache
        return lambda: attn.attention(q, kc, vc, out, batch, options, ws), _check(expected, out)

    prep.impls.append(Impl("fuselane", "fuselane", fuselane))
    if decode:
        other = _other_decode_kernel(p, opts, ws, expected)
        if other is not None:
            prep.impls.append(other)
    peers = ctx.peers
    if peers.unified_attention is not None:
        prep.impls.append(Impl("vllm-triton-unified", "vllm", _vllm_setup(ctx, p, m, expected)))
    if peers.flashinfer is not None:
        kind = _fi_kind(case)
        prep.impls.append(
            Impl(
                "flashinfer",
                "flashinfer",
                _flashinfer_setup(ctx, p, m, expected, kind),
                warm=warm_key(kind, m, cache_dtype)[0],
            )
        )
    seq = lens[0]
    sdpa_exact = m.softcap == 0 and (m.sliding_window is None or seq <= m.sliding_window)
    if case.section == "prefill" and peers.torch and sdpa_exact:
        backends = ["flash", "cudnn"] if ctx.device.type == "cuda" else [None]
        for backend in backends:
            name = "torch-sdpa" + (f"-{backend}" if backend else "")
            prep.impls.append(
                Impl(
                    name,
                    "torch",
                    _sdpa_setup(p, m, expected, backend),
                    extra={"layout": "dense, GQA expanded"},
                )
            )
    return prep


def _other_decode_kernel(
    p: aw.Problem, opts: dict, ws: attn.AttentionWorkspace, expected: aw.Expected
) -> Impl | None:
    """fuselane's decode kernel that the launch rule did not pick for `p`, where both could run
    it: Hopper's warp-specialized kernel (`fuselane-ws`), or where the rule took that one, the
    Triton kernel (`fuselane-triton`). None where the warp-specialized kernel cannot run it."""
    q, kc, vc = p.q, p.key_cache, p.value_cache
    if not attn.decode_warp_specialized_ok(q, kc, vc):
        return None
    shape = aw.plan_shape(p, ws)
    ws_decode = attn.decode_ws_config(**shape)
    if ws_decode is None:
        return None
    rule = attn.plan_launch(max_query_len=1, decode_warp_specialized=True, **shape)
    if rule.decode.warp_specialized:
        name = "fuselane-triton"
        plan = attn.plan_launch(max_query_len=1, decode_warp_specialized=False, **shape)
    else:
        name, plan = "fuselane-ws", attn.LaunchPlan(decode=ws_decode, prefill=None)
    batch, options = p.bundles(**opts)
    d = plan.decode
    extra = {
        "decode": f"splits={d.num_splits} budget={d.split_budget} tile={d.tile_n} s={d.num_stages}"
    }

    def setup():
        out = aw.nan_like(q)

        def fn():
            attn.run._run(q, kc, vc, out, batch, options, ws, plan=plan)

        return fn, _check(expected, out)

    return Impl(name, "fuselane", setup, extra=extra)


def _check(expected: aw.Expected, out: torch.Tensor) -> Check:
    return lambda: expected.check(out)


def _vllm_setup(ctx: Context, p: aw.Problem, m: ModelShape, expected: aw.Expected):
    def setup():
        out = aw.nan_like(p.q)
        hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_size
        scratch = VllmScratch.allocate(hq, hkv, d, ctx.device)
        window = (-1, -1) if m.sliding_window is None else (m.sliding_window - 1, 0)
        ua = ctx.peers.unified_attention
        fn = vllm_attention(
            ua, p, out, scratch, scale=m.head_size**-0.5, window=window, softcap=m.softcap
        )
        return fn, _check(expected, out)

    return setup


def _flashinfer_setup(ctx: Context, p: aw.Problem, m: ModelShape, expected: aw.Expected, kind: str):
    def setup():
        fi = ctx.peers.flashinfer
        out = aw.nan_like(p.q)
        workspace = ctx.peers.fi_workspace(ctx.device)
        hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_size
        window_left = -1 if m.sliding_window is None else m.sliding_window - 1
        common = dict(
            window_left=window_left,
            logits_soft_cap=m.softcap or None,
            q_data_type=DTYPE,
            kv_data_type=p.kv.dtype,
            sm_scale=d**-0.5,
        )
        # an fp8 cache's per-tensor scales, as vLLM's FlashInfer backend passes them (floats:
        # k's folds into the softmax scale, v's multiplies the output after the kernel)
        scales = {}
        if p.k_scale is not None:
            scales = dict(k_scale=float(p.k_scale), v_scale=float(p.v_scale))
        pages = (p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        if kind == "decode":
            w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            w.plan(*pages, hq, hkv, d, PAGE, **common)
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(p.cu, *pages, hq, hkv, d, PAGE, causal=True, **common)
        return lambda: w.run(p.q, p.kv, out=out, **scales), _check(expected, out)

    return setup


def _sdpa_setup(p: aw.Problem, m: ModelShape, expected: aw.Expected, backend: str | None):
    def setup():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        seq, group = p.lens[0], m.num_q_heads // m.num_kv_heads
        pages = p.block_table[0].long()
        shape = (-1, m.num_kv_heads, m.head_size)
        k = p.key_cache[pages].reshape(shape)[:seq].repeat_interleave(group, dim=1)
        v = p.value_cache[pages].reshape(shape)[:seq].repeat_interleave(group, dim=1)
        qd, kd, vd = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (p.q, k, v))
        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

        def fn():
            sdpa = torch.nn.functional.scaled_dot_product_attention
            if backend is None:
                return sdpa(qd, kd, vd, is_causal=True, scale=m.head_size**-0.5)
            with sdpa_kernel(chosen[backend]):
                return sdpa(qd, kd, vd, is_causal=True, scale=m.head_size**-0.5)

        return fn, lambda: expected.check(fn()[0].transpose(0, 1))

    return setup

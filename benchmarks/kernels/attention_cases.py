"""`fuselane bench kernels`, attention: decode, prefill and mixed batches of each model shape.

Inputs and checks are bench_attention's (attention_workload.py: `make_problem` over one random
KV pool per model; `Expected`: the reference's output and its tolerance), with the model's head
counts, head size, sliding window, soft cap and scale 1/sqrt(D). Every implementation's output
is compared with the reference on the timed inputs; fuselane is timed only if it matches.

Peers: vLLM's `unified_attention` (TRITON_ATTN's kernel, its split scratch sized as
triton_attn.py sizes it), FlashInfer's paged decode (tensor cores) and prefill wrappers
(`plan()` outside the timed call), torch SDPA's flash and cuDNN backends on dense,
GQA-expanded tensors for prefill (where SDPA can express the model: no soft cap, no window
shorter than the sequence).

Counted: decode moves the K and V rows it reads (the last `window` keys at most), q and out;
prefill and mixed do 4 * Hq * D FLOPs per visible (query, key) pair (QK^T and PV).
"""

from __future__ import annotations

import math

import torch

from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels.attention_timing import VllmScratch, vllm_attention
from fuselane.benchmarks.kernels.grid import PAGE, SIZES, Case, ModelShape
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


def pool_pages(grid: str) -> int:
    """KV pages for the largest attention case of a grid (one pool serves a model's cases)."""
    s = SIZES[grid]
    need = [b * math.ceil(n / PAGE) for b, n in s["decode"]]
    need += [math.ceil(n / PAGE) for n in s["prefill"]]
    need += [(c + d) * math.ceil(n / PAGE) for c, _, d, n in s["mixed"]]
    return max(need) + 64


def warm_key(kind: str, m: ModelShape) -> tuple[str, dict[str, object]]:
    """FlashInfer's JIT module for decode or prefill of this shape: (key, warm-up spec)."""
    key = f"{kind} D={m.head_size} window={m.sliding_window} softcap={m.softcap:g}"
    spec = {
        "kind": kind,
        "num_q_heads": m.num_q_heads,
        "num_kv_heads": m.num_kv_heads,
        "head_size": m.head_size,
        "window_left": -1 if m.sliding_window is None else m.sliding_window - 1,
        "softcap": m.softcap,
    }
    return key, spec


def warmups(case: Case) -> dict[str, dict[str, object]]:
    key, spec = warm_key("decode" if case.section == "decode" else "prefill", case.shape)
    return {key: spec}


def prepare(ctx: Context, case: Case) -> Prepared:
    m, size = case.shape, case.params
    if case.section == "decode":
        q_lens, lens = [1] * size["batch"], [size["context"]] * size["batch"]
    elif case.section == "prefill":
        q_lens, lens = [size["seq_len"]], [size["seq_len"]]
    else:
        rows = size["decodes"] + size["chunks"]
        q_lens = [1] * size["decodes"] + [size["chunk_len"]] * size["chunks"]
        lens = [size["context"]] * rows
    hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_size
    pool = ctx.keep(
        f"kv_pool:{hkv}x{d}",
        lambda: aw.make_pool(pool_pages(ctx.grid), PAGE, hkv, d, DTYPE),
    )
    ws = ctx.keep(
        f"attn_workspace:{hq}x{d}",
        lambda: attn.AttentionWorkspace.allocate(
            aw.WS_ROWS, hq, d, ctx.device, max_splits=aw.WS_SPLITS
        ),
    )
    p = aw.make_problem(q_lens, lens, generator(ctx.device, case.seed), kv=pool, hq=hq)
    opts = {"scale": d**-0.5, "sliding_window": m.sliding_window, "softcap": m.softcap}
    expected = aw.Expected(p, case.section == "prefill", **opts)
    prep = Prepared(impls=[], extra={"window": m.sliding_window, "softcap": m.softcap})
    if case.section == "decode":
        keys = sum(n if m.sliding_window is None else min(n, m.sliding_window) for n in lens)
        prep.nbytes = keys * hkv * d * 2 * p.kv.element_size() + 2 * p.q.numel() * 2
    else:
        pairs = sum(
            visible_pairs(q, n, m.sliding_window) for q, n in zip(q_lens, lens, strict=True)
        )
        prep.flops = 4.0 * hq * d * pairs

    def fuselane():
        out = aw.nan_like(p.q)
        args = p.args(**opts)
        return lambda: attn.paged_attention(out=out, workspace=ws, **args), _check(expected, out)

    prep.impls.append(Impl("fuselane", "fuselane", fuselane))
    peers = ctx.peers
    if peers.unified_attention is not None:
        prep.impls.append(Impl("vllm-triton-unified", "vllm", _vllm_setup(ctx, p, m, expected)))
    if peers.flashinfer is not None:
        kind = "decode" if case.section == "decode" else "prefill"
        prep.impls.append(
            Impl(
                "flashinfer",
                "flashinfer",
                _flashinfer_setup(ctx, p, m, expected, kind),
                warm=warm_key(kind, m)[0],
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
            kv_data_type=DTYPE,
            sm_scale=d**-0.5,
        )
        pages = (p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        if kind == "decode":
            w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            w.plan(*pages, hq, hkv, d, PAGE, **common)
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(p.cu, *pages, hq, hkv, d, PAGE, causal=True, **common)
        return lambda: w.run(p.q, p.kv, out=out), _check(expected, out)

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

"""`fuselane bench kernels`, KV-cache writes: bf16 and fp8 (quantize-on-write) paged writes and the
fused RoPE + write, for each model's KV shape.

Inputs are bench_kv_cache's (kv_cache_workload.py; `make_batch`: up to 256 tokens are a decode
batch, more are 2048-token prefill chunks, pages a random permutation; `make_cache`: TRITON_ATTN's
layout, K and V as views of one NaN-poisoned tensor; `rope_cos_sin`), with the model's heads and
head size; key, value (and query) are strided views of one fused QKV output. fuselane's cache must
equal the reference's bit for bit on the timed inputs (fused RoPE: q and k within rounding of
the reference rotary); a peer that writes other bytes is timed and says so in its row.

Peers: vLLM's `triton_reshape_and_cache_flash` (auto / fp8), FlashInfer's
`append_paged_kv_cache` (bf16 only: it has no quantize-on-write), torch `index_copy_` into
the slot-flattened cache (fp8: after the reference quantizer); for RoPE, torch's rotary (the
reference) followed by fuselane's or vLLM's write.

Counted: key and value read and written and the slot read; RoPE adds q read and written, k
written back, one cos/sin row and a position per token.
"""

from __future__ import annotations

import torch

from fuselane.benchmarks.kernels import kv_cache_workload as kvw
from fuselane.benchmarks.kernels.grid import PAGE, Case, ModelShape
from fuselane.benchmarks.kernels.impls import Check, Context, Impl, Prepared, generator
from fuselane.kernels import kv_cache as kvc

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
ROPE_MAX_POS = kvw.DECODE_MAX_CONTEXT + kvw.PREFILL_CHUNK  # past every position make_batch draws


def warmups(case: Case) -> dict[str, dict[str, object]]:
    return {"page": {"kind": "page"}} if case.section == "kv_write" else {}


def prepare(ctx: Context, case: Case) -> Prepared:
    tokens = case.params["tokens"]
    gen = generator(ctx.device, case.seed)
    batch = kvw.make_batch(tokens, gen)
    m = case.shape
    q, k, v = kvw.make_qkv(tokens, gen, DTYPE, m.num_q_heads, m.num_kv_heads, m.head_size)
    if case.section == "rope_kv_write":
        return _rope(ctx, m, batch, q, k, v)
    return _write(ctx, m, batch, k, v, fp8=case.section == "kv_write_fp8")


def _write(ctx: Context, m: ModelShape, batch, k, v, fp8: bool) -> Prepared:
    hkv, d, dev = m.num_kv_heads, m.head_size, ctx.device
    tokens, slots = batch.num_tokens, batch.slot_mapping
    cache_dtype = FP8 if fp8 else DTYPE
    base, kc, vc = kvw.make_cache(batch.num_pages, cache_dtype, PAGE, hkv, d)
    want, kw, vw = kvw.make_cache(batch.num_pages, cache_dtype, PAGE, hkv, d)
    k_scale = torch.tensor([kvw.K_SCALE if fp8 else 1.0], device=dev)
    v_scale = torch.tensor([kvw.V_SCALE if fp8 else 1.0], device=dev)
    scales = (k_scale, v_scale) if fp8 else ()
    kvc.kv_cache_update_reference(k, v, kw, vw, slots, *scales)

    def exact() -> tuple[bool, str]:
        bad = kvw.mismatches(base, want)
        return bad == 0, f"{bad} of {base.numel()} cache elements differ bitwise from the reference"

    def impl(name: str, peer: str, call, warm: str | None = None) -> Impl:
        def setup():
            kvw.poison(base)  # what a call does not write stays NaN and fails the check
            return call, exact

        return Impl(name, peer, setup, warm=warm)

    impls = [
        impl("fuselane", "fuselane", lambda: kvc.kv_cache_update(k, v, kc, vc, slots, *scales))
    ]
    peers = ctx.peers
    if peers.torch:
        name, torch_write = kvw.torch_write(k, v, kc, vc, slots, scales or None)
        impls.append(impl(name, "torch", torch_write))
    if peers.reshape_and_cache_flash is not None:
        kv_dtype = "fp8" if fp8 else "auto"
        impls.append(
            impl(
                "vllm-triton-reshape_and_cache_flash",
                "vllm",
                lambda: peers.reshape_and_cache_flash(
                    k, v, kc, vc, slots, kv_dtype, k_scale, v_scale
                ),
            )
        )
    if peers.flashinfer is not None and not fp8:
        fi = peers.flashinfer

        def flashinfer_setup():
            call = kvw.flashinfer_append(fi, batch, k, v, kc, vc)
            kvw.poison(base)
            return call, exact

        impls.append(
            Impl("flashinfer-append_paged_kv_cache", "flashinfer", flashinfer_setup, warm="page")
        )
    nbytes = tokens * hkv * d * 2 * (k.element_size() + base.element_size()) + tokens * 8
    return Prepared(impls, nbytes=nbytes, extra={"cache_dtype": str(cache_dtype)[6:]})


def _rope(ctx: Context, m: ModelShape, batch, q, k, v) -> Prepared:
    hq, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_size
    tokens, pos, slots = batch.num_tokens, batch.positions, batch.slot_mapping
    cs = kvw.rope_cos_sin(ROPE_MAX_POS, d, DTYPE)
    base, kc, vc = kvw.make_cache(batch.num_pages, DTYPE, PAGE, hkv, d)
    atol, rtol = kvw.ROTARY_TOL[DTYPE]

    def fused():
        kvc.rope_kv_cache_update(pos, q, k, v, cs, True, kc, vc, slots)

    def fused_setup():
        # q and k rotate in place, call after call (norms are kept): the reference is taken
        # from the values the first call starts from
        want_q = kvc.rotary_reference(pos, q, cs, True)
        want_k = kvc.rotary_reference(pos, k, cs, True)
        kvw.poison(base)
        return fused, _rope_check(m, batch, q, k, v, want_q, want_k, base, atol, rtol)

    then_fuselane = kvw.rotary_then(
        pos, q, k, cs, True, lambda: kvc.kv_cache_update(k, v, kc, vc, slots)
    )

    impls = [Impl("fuselane", "fuselane", fused_setup)]
    peers = ctx.peers
    if peers.torch:
        impls.append(Impl("torch-rotary+fuselane-write", "torch", lambda: (then_fuselane, None)))
    if peers.reshape_and_cache_flash is not None:
        one = torch.ones(1, device=ctx.device)

        def vllm_write():
            peers.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one)

        then_vllm = kvw.rotary_then(pos, q, k, cs, True, vllm_write)

        impls.append(Impl("torch-rotary+vllm-write", "vllm", lambda: (then_vllm, None)))
    el = q.element_size()
    nbytes = (
        tokens * hq * d * el * 2  # q read and written
        + tokens * hkv * d * (el * 2 + el)  # k read, written back, written to the cache
        + tokens * hkv * d * (el + el)  # v read, written to the cache
        + tokens * (d * el + 16)  # cos/sin row, position and slot
    )
    return Prepared(impls, nbytes=nbytes, extra={"rope": "neox", "cache_dtype": "bfloat16"})


def _rope_check(m: ModelShape, batch, q, k, v, want_q, want_k, base, atol, rtol) -> Check:
    def check() -> tuple[bool, str]:
        close = torch.allclose(q, want_q, atol=atol, rtol=rtol) and torch.allclose(
            k, want_k, atol=atol, rtol=rtol
        )
        # the cache must hold exactly what the reference write makes of the rotated key
        want, kw, vw = kvw.make_cache(batch.num_pages, DTYPE, PAGE, m.num_kv_heads, m.head_size)
        kvc.kv_cache_update_reference(k, v, kw, vw, batch.slot_mapping)
        bad = kvw.mismatches(base, want)
        ok = close and bad == 0
        return ok, f"q/k within atol {atol} rtol {rtol}: {close}; {bad} cache elements differ"

    return check

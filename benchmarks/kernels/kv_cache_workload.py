"""The KV-cache script's workload (bench_kv_cache): its cases, their inputs and what they move.

Llama-3-8B attention shapes (Hkv=8, D=128, page 16, bf16); key/value are strided views of a
fused QKV output (Hq=32); the cache is vLLM's TRITON_ATTN layout, K and V as `split` views of
one NaN-poisoned [num_pages, page, Hkv, 2*D] tensor. Up to DECODE_MAX_TOKENS tokens are a decode
batch (one token per request, random context lengths); more are prefill chunks of
PREFILL_CHUNK tokens; pages are a random permutation. Caches are compared bit for bit
(`mismatches`). `fuselane bench kernels` builds its KV-cache cases with the same helpers
(kv_cache_cases.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fuselane.kernels import kv_cache as kvc

HQ, HKV, D, PAGE = 32, 8, 128, 16
TOKENS = (1, 16, 256, 4096, 32768)
ROPE_TOKENS = (1, 64, 1024, 8192)  # neox
ROPE_GPTJ_TOKENS = (1, 8192)
DECODE_MAX_TOKENS = 256  # up to this many tokens: one token per request
PREFILL_CHUNK = 2048
DECODE_MAX_CONTEXT = 512
K_SCALE, V_SCALE = 0.05, 0.04  # fp8 scales: randn / 0.05 stays well inside +-448
FP8 = torch.float8_e4m3fn
# Where the script's tensors live: read at call time (`kv_cache_workload.DEVICE` in the other
# KV-cache modules), so that `impls.bench_scripts_on` can point it elsewhere (the interpreter
# smoke run of `fuselane bench kernels` builds its inputs on the CPU).
DEVICE = "cuda"
# GPU check tolerances for rotated q/k: fp32 math may contract to FMA on the GPU, so a value can
# round one ulp away from the reference's; the cache copy itself is compared bit for bit.
ROTARY_TOL = {
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (1e-5, 1e-5),
}


def case_name(tokens: int) -> str:
    return f"tokens={tokens} Hkv={HKV} D={D} page={PAGE}"


def rope_case_name(tokens: int, neox: bool = True) -> str:
    return f"tokens={tokens} Hq={HQ} Hkv={HKV} D={D} page={PAGE} {'neox' if neox else 'gptj'}"


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's page table, as vLLM (slot_mapping) and FlashInfer (indptr form) see it."""

    num_tokens: int
    num_pages: int
    slot_mapping: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    append_indptr: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32


def make_batch(num_tokens: int, gen: torch.Generator, page: int = PAGE) -> Batch:
    if num_tokens <= DECODE_MAX_TOKENS:
        append = [1] * num_tokens
        seq = torch.randint(1, DECODE_MAX_CONTEXT + 1, (num_tokens,), generator=gen).tolist()
    else:
        append = [PREFILL_CHUNK] * (num_tokens // PREFILL_CHUNK)
        if num_tokens % PREFILL_CHUNK:
            append.append(num_tokens % PREFILL_CHUNK)
        seq = list(append)
    pages_per_req = [math.ceil(s / page) for s in seq]
    num_pages = sum(pages_per_req)
    perm = torch.randperm(num_pages, generator=gen)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per_req).cumsum(0).tolist()])
    slots, positions = [], []
    for b, (a, s) in enumerate(zip(append, seq, strict=True)):
        pos = torch.arange(s - a, s)
        pages = perm[kv_indptr[b] : kv_indptr[b + 1]]
        slots.append(pages[pos // page] * page + pos % page)
        positions.append(pos)
    last = [s - (p - 1) * page for s, p in zip(seq, pages_per_req, strict=True)]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return Batch(
        num_tokens=num_tokens,
        num_pages=num_pages,
        slot_mapping=torch.cat(slots).to(DEVICE),
        positions=torch.cat(positions).to(DEVICE),
        kv_indptr=kv_indptr.to(**i32),
        kv_indices=perm.to(**i32),
        kv_last_page_len=torch.tensor(last, **i32),
        append_indptr=torch.tensor([0, *torch.tensor(append).cumsum(0).tolist()], **i32),
        seq_lens=torch.tensor(seq, **i32),
    )


def make_qkv(
    num_tokens: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as strided [T, H, D] views of one fused QKV output."""
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)


def make_cache(
    num_pages: int, dtype: torch.dtype, page: int = PAGE, heads: int = HKV, head_size: int = D
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base, key_cache, value_cache): vLLM TRITON_ATTN views of one poisoned tensor."""
    base = torch.empty(num_pages, page, heads, 2 * head_size, dtype=dtype, device=DEVICE)
    poison(base)
    key_cache, value_cache = base.split(head_size, dim=-1)
    return base, key_cache, value_cache


def poison(t: torch.Tensor) -> None:
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        t.fill_(float("nan"))


def bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(torch.uint8).view(width) if t.dtype == FP8 else t.view(width)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (the NaN poison included)."""
    return int((bits(a) != bits(b)).sum())


def rope_cos_sin(max_pos: int, rot_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE, dtype)


def flashinfer_append(
    fi: Any, batch: Batch, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
) -> Callable[[], object]:
    """FlashInfer's `append_paged_kv_cache` of k and v into the cache views (kc, vc) at the
    batch's pages; its batch indices and positions are computed here, outside the timed call."""
    bi, pos = fi.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.num_tokens)
    pages = (batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    return lambda: fi.append_paged_kv_cache(k, v, bi, pos, (kc, vc), *pages, "NHD")


def torch_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[str, Callable[[], None]]:
    """torch's write, (its impl name, the call): `index_copy_` into the slot-flattened cache
    views; with fp8 `scales`, of the reference quantizer's codes."""
    kc_flat, vc_flat = kc.flatten(0, 1), vc.flatten(0, 1)
    if scales is None:

        def index_copy() -> None:
            kc_flat.index_copy_(0, slots, k)
            vc_flat.index_copy_(0, slots, v)

        return "torch-index_copy", index_copy
    k_scale, v_scale = scales
    kc_u8, vc_u8 = kc_flat.view(torch.uint8), vc_flat.view(torch.uint8)

    def quant_index_copy() -> None:
        kq = kvc.quantize_e4m3_reference(k, k_scale).view(torch.uint8)
        vq = kvc.quantize_e4m3_reference(v, v_scale).view(torch.uint8)
        kc_u8.index_copy_(0, slots, kq)
        vc_u8.index_copy_(0, slots, vq)

    return "torch-quant+index_copy", quant_index_copy


def rotary_then(
    pos: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cs: torch.Tensor,
    neox: bool,
    write: Callable[[], object],
) -> Callable[[], None]:
    """torch's rotary of q and k in place (the reference's), then `write`: the fused RoPE +
    write's peers, made of separate steps."""

    def call() -> None:
        q.copy_(kvc.rotary_reference(pos, q, cs, neox))
        k.copy_(kvc.rotary_reference(pos, k, cs, neox))
        write()

    return call


def fp8_scales() -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) of the fp8 cases, as tensors on DEVICE."""
    return torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE)


def write_bytes(tokens: int, in_bytes: int, cache_bytes: int) -> int:
    """K and V: read once, written once; plus the slot mapping."""
    return tokens * HKV * D * 2 * (in_bytes + cache_bytes) + tokens * 8


def rope_bytes(tokens: int, cache_bytes: int) -> int:
    """q read+write, k read+write+cache, v read+cache, one cos/sin row, positions and slots."""
    el = 2  # bf16
    q = tokens * HQ * D * el * 2
    k = tokens * HKV * D * (el * 2 + cache_bytes)
    v = tokens * HKV * D * (el + cache_bytes)
    return q + k + v + tokens * (D * el + 16)

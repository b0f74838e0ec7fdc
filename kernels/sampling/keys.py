"""Order-preserving int32 keys of fp32 values, and vLLM V2's murmur3 Gumbel noise, as Triton
device functions of the fused sampler. A candidate is stored as one int64 `key << 32 | token`;
NaN reads as -inf and -0 as +0."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# vLLM V1 `_SAMPLING_EPS`: temperatures below it mean greedy.
SAMPLING_EPS = 1e-5
# key(-inf); key(-FLT_MAX). ">= KEY_NO_BOUND" holds for every finite value and nothing else.
KEY_NEG_INF = -2139095041
KEY_NO_BOUND = -2139095040

_LOG2E = tl.constexpr(LOG2E)
_EPS = tl.constexpr(SAMPLING_EPS)
_KEY_NO_BOUND = tl.constexpr(KEY_NO_BOUND)


@triton.jit
def key(v):
    """Order-preserving int32 key of fp32 values (no NaN): negative floats get their 31 low bits
    flipped, so signed int order = float order; -0 maps to the key of +0."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(v == 0.0, 0, b)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def unkey(k):
    """Inverse of `key` (int32 in, fp32 out)."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rotl32(v, s: tl.constexpr):
    return (v << s) | (v >> (32 - s))


@triton.jit
def _murmur3_mix(h, k):
    # murmur3_32 block mix with uint32 wrap-around, exactly as vLLM V2's sample/gumbel.py.
    k *= 0xCC9E2D51
    k = _rotl32(k, 15)
    k *= 0x1B873593
    h ^= k
    h = _rotl32(h, 13)
    return h * 5 + 0xE6546B64


@triton.jit
def _murmur3_fmix(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def noise_row_state(seed, pos):
    """murmur3 state after (seed low word, seed high word, position): the per-row hash prefix."""
    seed = seed.to(tl.int64)
    pos = pos.to(tl.int64)
    h = (seed ^ seed).to(tl.uint32)
    h = _murmur3_mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    return h


@triton.jit
def _log1p_neg(u):
    # log(1 - u): degree-8 series below 0.25 keeps precision in the winning Gumbel tail (V2).
    poly = 1.0 / 8.0
    poly = 1.0 / 7.0 + u * poly
    poly = 1.0 / 6.0 + u * poly
    poly = 1.0 / 5.0 + u * poly
    poly = 1.0 / 4.0 + u * poly
    poly = 1.0 / 3.0 + u * poly
    poly = 1.0 / 2.0 + u * poly
    poly = 1.0 + u * poly
    series = -u * poly
    direct = tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08))
    return tl.where(u < 0.25, series, direct)


@triton.jit
def gumbel(h, tokens):
    """Gumbel(0, 1) noise of `tokens` (int) for the row whose hash prefix is `h`:
    u = (murmur3(seed, pos, token) + 0.5) / 2^32 from two exact 16-bit halves,
    g = -log(-log(1 - u))."""
    r = _murmur3_fmix(_murmur3_mix(h, tokens.to(tl.uint32)) ^ 16)
    hi16 = (r >> 16).to(tl.int32)
    lo16 = (r & 0xFFFF).to(tl.int32)
    u = (
        hi16.to(tl.float32) * 1.52587890625e-05
        + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    )
    return -tl.log(-_log1p_neg(u))

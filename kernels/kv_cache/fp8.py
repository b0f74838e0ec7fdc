"""fp8 e4m3 quantize-on-write: the conversion helpers the write kernels share (Triton 3.6's
own fp32 -> e4m3 cast rounds ties up, so the rounding is done by hand)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._checks import FP8_E4M3_MAX

_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
# e4m3 has 3 mantissa bits and its smallest normal exponent is -6: below 2^-6 the spacing stays
# 2^-9 (subnormals). In fp32 bits: exponent field of 2^-6, and the shift that makes an fp32
# sum's last mantissa bit (2^-23 relative) worth 2^-3 relative: 23 - 3 = 20.
_F32_EXP_MASK = tl.constexpr(0x7F800000)
_F32_SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as an int32
_E4M3_MIN_NORMAL_EXP_BITS = tl.constexpr((127 - 6) << 23)
_E4M3_SPACING_SHIFT = tl.constexpr(20 << 23)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3_grid(y):
    """Round fp32 `y` (|y| <= 448) to the nearest e4m3 value, ties to even; result still fp32.

    Interpreter only (see `_to_e4m3`): the fp32 -> fp8 cast after this only drops zero bits, so
    Triton's interpreter (whose own cast rounds ties up and can lose the carry into the
    exponent) stores the byte the GPU's cvt.rn.satfinite stores. ~8 integer/float ops/element.
    Formula: with 2^e the power of two of |y| (at least 2^-6), c = 2^(e+20) makes the last
    mantissa bit of the fp32 sum |y| + c worth 2^(e-3), e4m3's spacing at exponent e; fp32
    addition rounds to nearest even and subtracting c again is exact. The sign is copied back
    bitwise so that -0.0 stays -0.0 (torch stores 0x80 for it).
    """
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    exp_bits = tl.maximum(a.to(tl.int32, bitcast=True) & _F32_EXP_MASK, _E4M3_MIN_NORMAL_EXP_BITS)
    c = (exp_bits + _E4M3_SPACING_SHIFT).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & _F32_SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, inv_scale, EMULATE: tl.constexpr):
    """e4m3(saturate(x * inv_scale, +-448)), ties to even, as float8e4nv; inv_scale = 1 / scale.

    GPU (EMULATE=False): one fp32 multiply, then the native cast, which Triton lowers to
    cvt.rn.satfinite.e4m3x2.f32 (SASS `F2FP.SATFINITE.E4M3.F32.PACK_AB`, two elements per
    instruction: round to nearest even, +-inf and |y| > 448 saturate to +-448, NaN stays NaN):
    the saturation is the cast's own, so no clamp is needed. Interpreter (EMULATE=True): Triton
    3.6's interpreter casts with ties rounded up and can lose the carry into the exponent
    (124.3 -> 64), so y is clamped and rounded to the e4m3 grid in fp32 first.
    """
    y = x.to(tl.float32) * inv_scale
    if EMULATE:
        y = tl.maximum(y, -_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = _round_to_e4m3_grid(y)
        # The interpreter's cast stores a NaN as a number (0x7C): store the canonical e4m3 NaN
        # byte 0x7F, as the GPU's cast and torch do (a NaN scale, say).
        nan = tl.full(y.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)
        return tl.where(y != y, nan, y.to(tl.float8e4nv))
    return y.to(tl.float8e4nv)


@triton.jit
def _inv_scale(scale):
    """1 / scale (fp32), IEEE-rounded, once per program: the per-element work is then one
    multiply instead of a ~15-instruction IEEE division. x * (1/scale) is within one fp32 ulp of
    x / scale (what vLLM computes, itself with an approximate division), far below e4m3's
    2^-4 rounding step; the reference computes the same product, so the bytes match exactly.
    The division has a slow-path subroutine call the compiler does not move loads across, so
    every load of the program is issued before it (the scales first of all)."""
    return tl.math.div_rn(1.0, scale.to(tl.float32))

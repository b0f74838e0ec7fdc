"""Repetition / frequency / presence penalties written into the logits, for seen tokens only.

Applied to every value it loads, the penalties cost the chunk kernel about 25 instructions per
value (B=256 x V=151936: 207 us against 119 us without them), for the ~1.5% of tokens a
request has seen (2000 prompt + 256 output ids); the kernel is bound by instruction issue, not
DRAM. When the caller lets the logits be overwritten (vLLM's V1 sampler penalizes its fp32
logits in place as well), each chunk program first walks the set bits of its chunk's packed
words (`penalize_words`: one word per lane, lowest bit first), rewrites only the seen tokens,
and then reads its chunk as the plain variant does: the rewritten sectors are still in cache.
Per token the arithmetic and its order are those of `tiles._process`, so both paths
give bit-identical values.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

GROUP = 32  # tokens per word of the packed prompt/output bit masks
# Bit steps per loop iteration of `penalize_words`: 4 issues four steps' gathers together (the
# 8 loads ahead of the 4 stores), so a chunk whose words hold at most 4 seen tokens waits for
# one round of gathers instead of up to four. B=256 +pen+min-p on an H200
# (benchmarks/results/sampling-h200-2026-11-25.json): 145.4 us with 4 against 149.4 with 1
# (plain case 115.9); B=1 / 32 equal within 0.3 us. Read at every launch.
BIT_STEPS = 4


@triton.jit
def penalize_words(
    xrow,
    crow,
    prow,
    orow,
    w0,
    V,
    rep,
    freq,
    pres,
    WORDS: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    STEPS: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Penalize the seen tokens of packed words [w0, w0 + WORDS) of one row in place: xrow the
    row's fp32 logits, crow its output counts, prow / orow its prompt / output bit words (orow
    unused without HAS_OUT_MASK: the bits come from a read of the counts). NaN stays NaN;
    unseen tokens are neither read nor written."""
    NW = (V + 31) // 32
    w = w0 + tl.arange(0, WORDS)
    wok = w < NW
    if HAS_OUT_MASK:
        ow = tl.load(orow + w, mask=wok, other=0)
    else:
        # the output bits from a coalesced read of the counts (distinct bits: sum = or)
        j = tl.arange(0, 32)[None, :]
        tok2 = w[:, None] * 32 + j
        dense = tl.load(crow + tok2, mask=tok2 < V, other=0)
        ow = tl.sum(tl.where(dense > 0, 1 << j, 0), axis=1)
    # A token only in the prompt changes only under a repetition penalty.
    todo = ow
    if rep != 1.0:
        todo = todo | tl.load(prow + w, mask=wok, other=0)
    inv_rep = div(1.0, rep, EXACT)
    # One set bit per lane per step, lowest first: as many steps as the most bits one word
    # holds, not 32. The count is taken once (SWAR popcount), so the steps need no barrier
    # and each warp walks its words at its own pace. STEPS = 1 or 4 steps per iteration.
    u = todo.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    steps = tl.max(((u * 0x01010101) >> 24).to(tl.int32), axis=0)
    if STEPS == 4:
        # four steps per iteration: their gathers are independent, all in flight at once
        for _ in range(0, steps, 4):
            todo, t0, h0, o0 = _next_bit(todo, w, ow, V)
            todo, t1, h1, o1 = _next_bit(todo, w, ow, V)
            todo, t2, h2, o2 = _next_bit(todo, w, ow, V)
            todo, t3, h3, o3 = _next_bit(todo, w, ow, V)
            y0 = tl.load(xrow + t0, mask=h0, other=0.0)
            y1 = tl.load(xrow + t1, mask=h1, other=0.0)
            y2 = tl.load(xrow + t2, mask=h2, other=0.0)
            y3 = tl.load(xrow + t3, mask=h3, other=0.0)
            c0 = tl.load(crow + t0, mask=o0, other=0)
            c1 = tl.load(crow + t1, mask=o1, other=0)
            c2 = tl.load(crow + t2, mask=o2, other=0)
            c3 = tl.load(crow + t3, mask=o3, other=0)
            tl.store(xrow + t0, _penalized(y0, c0, o0, rep, inv_rep, freq, pres, EXACT), mask=h0)
            tl.store(xrow + t1, _penalized(y1, c1, o1, rep, inv_rep, freq, pres, EXACT), mask=h1)
            tl.store(xrow + t2, _penalized(y2, c2, o2, rep, inv_rep, freq, pres, EXACT), mask=h2)
            tl.store(xrow + t3, _penalized(y3, c3, o3, rep, inv_rep, freq, pres, EXACT), mask=h3)
    else:
        tl.static_assert(STEPS == 1, "STEPS: 1 or 4")
        for _ in range(steps):
            todo, tok, hit, obit = _next_bit(todo, w, ow, V)
            y = tl.load(xrow + tok, mask=hit, other=0.0)
            cnt = tl.zeros_like(tok)
            if freq != 0.0:
                cnt = tl.load(crow + tok, mask=obit, other=0)
            tl.store(
                xrow + tok, _penalized(y, cnt, obit, rep, inv_rep, freq, pres, EXACT), mask=hit
            )


@triton.jit
def _next_bit(todo, w, ow, V):
    """The lowest set bit of each word: (todo without it, its token, whether there is one,
    whether it is an output token)."""
    low = todo & (-todo)
    # bit index = exponent of the (exact) fp32 value of the power of two
    lowf = low.to(tl.uint32, bitcast=True).to(tl.float32)
    pos = (lowf.to(tl.int32, bitcast=True) >> 23) - 127
    tok = w * 32 + pos
    hit = (low != 0) & (tok < V)
    obit = hit & (((ow >> pos) & 1) != 0)
    return todo ^ low, tok, hit, obit


# Whether the kernels run under Triton's interpreter (numpy: never an fma, no inline PTX).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


# The arithmetic of temperature and penalties, in one of two roundings (EXACT, a constexpr):
# - True: each operation rounded as torch rounds it, which is what vLLM's V1 sampler computes
#   (`logits.div_(temperature)`, penalties as separate tensor operations);
# - False: Triton's own fp32 arithmetic, which is what vLLM's V2 sampler computes (its Triton
#   kernels): `/` is div.full.f32 (within 2 ulp) and ptxas fuses `y - f * c` into one fma.
# Under the interpreter (numpy) both are torch's.


@triton.jit
def div(a, b, EXACT: tl.constexpr):
    """a / b (fp32) in the rounding EXACT selects."""
    if EXACT:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def mul(a, b, EXACT: tl.constexpr):
    """a * b (fp32), with EXACT rounded on its own: an explicit mul.rn, which ptxas never
    contracts into a following subtraction."""
    if EXACT and not _INTERPRETED:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _penalized(y, cnt, obit, rep, inv_rep, freq, pres, EXACT: tl.constexpr):
    """vLLM's order: repetition (every seen token), frequency, presence."""
    if rep != 1.0:
        y = y * tl.where(y > 0, inv_rep, rep)
    if freq != 0.0:
        y = y - mul(freq, cnt.to(tl.float32), EXACT)
    if pres != 0.0:
        y = y - mul(pres, obit.to(tl.float32), EXACT)
    return y

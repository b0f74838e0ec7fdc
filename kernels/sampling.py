"""Fused logits processing and sampling: penalties, bias, temperature, min-p, top-k, top-p, draw.

Semantics (per row of `logits [B, V]`, vLLM's step order; the torch references at the bottom of
this file define them exactly):

1. `x` = logits in fp32; NaN -> -inf (never sampled; counted per row in `nan_rows`).
2. logit bias: `y[t] += bias` for each (token, value) of the row's state slot (vLLM V2 keeps
   them per request slot as padded lists; min_tokens stop-token masking is a bias of -inf).
   Duplicated tokens add up, in list order.
3. penalties (vLLM's formulas and order): repetition `y *= (y > 0 ? 1/r : r)` where the token is
   in the prompt or the output; frequency `y -= f * count`; presence `y -= p * (count > 0)`.
4. temperature: `z = y / T`; rows with `T < 1e-5` are greedy (vLLM V1's `_SAMPLING_EPS`;
   vLLM's SamplingParams only produces T = 0 or T >= 0.01) and keep `z = y`.
5. min-p: remove `z < max(z) + log(min_p)` (V2's formula; V1 compares probabilities, the same
   set up to rounding).
6. top-k on the survivors: keep `z >= ` the k-th largest value. TIES: every token equal to the
   k-th value is kept (vLLM's torch paths do the same; vLLM's Triton top-k keeps exactly k,
   lowest token ids first). k <= 0 or k >= V is off.
7. top-p on the survivors, renormalised: with S(v) = sum of exp(z) over survivors with z >= v,
   keep `z >= tau_p`, tau_p = the largest value with S(tau_p) >= p * S(-inf). A token is kept
   iff the mass strictly above it is < p; TIES at the boundary are all kept (vLLM's sort path
   keeps an arbitrary part of the tie). p >= 1 is off.
8. draw: greedy rows take argmax(y) (lowest token id on ties); random rows take
   argmax(z + g) over the kept set, g = Gumbel noise as a pure function of
   (seed, offset, token): vLLM V2's `murmur3(seed, position, token)` and its
   `-log(-log1p(-u))` transform, so a V2 plugin reproduces stock draws. Gumbel-max over the
   kept set draws exactly from softmax(z) renormalised to it.

Log-probabilities (`logprobs_mode` as in vLLM): raw_logprobs = log_softmax(x), raw_logits = x,
processed_logits = z with -inf where removed, processed_logprobs = log_softmax of those.
`topn` lists the n best tokens by the mode's ordering (raw: x; processed: z before the masks,
so removed tokens follow the kept ones with -inf); ties by lowest id; id -1 pads rows with
fewer than n finite values.

Algorithm (two launches):
* `_sample_chunk_kernel`, grid (chunks, B): one program reads CHUNK logits of one row once, keeps
  them in registers, applies bias/penalties/temperature, and writes per-chunk partials: max and
  sum of exp (softmax normaliser), finite and NaN counts, and a candidate list: the chunk's
  largest values (at most CAP, in token order) with the largest value it left out ("floor":
  every value above it is listed). The cut is chosen on the maxima of 4-token rows (the
  smallest of 16, or 8, super-group maxima; no sort), and only the rows reaching it are
  gathered again (cache hits, the same elementwise processing) for the exact cut and the
  compaction, so the whole chunk pays for the row maxima alone. Rows without any truncation
  draw here directly (Gumbel argmax per chunk). With `logits_writable` (fp32, no bias, no raw
  logprobs) the program first rewrites its chunk's seen tokens with their penalized values
  (`sampling_penalties.penalize_words`), then reads the chunk as plain logits.
* `_sample_combine_kernel`, grid (B,): merges the partials of a row. Thresholds are int32
  order-preserving keys: top-k by a bisection over the candidate list that stops once one listed
  key is left in its bracket; then the top-k / min-p survivors (at most 64) are gathered, and
  top-p (each survivor's mass at or above it, against p times theirs) and the draw run over
  them; without top-k / min-p, top-p searches the list by mass. Exact whenever the threshold
  lies above every chunk's floor, which the kernel checks. Otherwise (very flat rows, k far
  above CAP, massive ties) the same program runs an exact fallback: 16-way key search with
  passes over the row, then a draw pass. `fallback_rows` reports which rows took it.

NaN policy: NaN logits are never sampled and never enter a normaliser; `nan_rows[b]` counts them
(device tensor, no host sync). The plugin should treat nan_rows > 0 as a model error for that
request (vLLM itself would sample garbage): abort the request or route the batch to the stock
sampler, as its policy says. A row with no finite value left returns token 0, logprob -inf.
+inf logits are not supported (vLLM turns them into NaN as well).

vLLM 0.32 vs 0.33 (what the plugin adapts): V2 `SamplingStates.get_top_k_top_p` returns
(top_k, top_p) in 0.32 and adds `has_topp_only_rows` in 0.33; V2's Gumbel gained
`spec_step_seed` (seed ^ (draft column << 32)) for draft logits caches in 0.33; V2 penalties'
block size became the module constant PENALTIES_BLOCK_SIZE; V1's Triton top-k got a fast path
for rows with <= k finite logits. The sampling formulas used here are the same in both.
V1 differs from V2 in ways the plugin must route: V1 draws exponential noise from torch
generators (draws cannot match bit for bit), keeps exactly k in its Triton top-k, and an
all-greedy V1 batch returns processed logprobs without the top-k/top-p masks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import sampling_penalties
from ._checks import check_choice, check_kernel_device, check_tensor
from ._launch import cdiv, launch, use_custom_op
from .sampling_penalties import GROUP, penalize_words
from .sampling_select import (
    KEY_NEG_INF,
    KEY_NO_BOUND,
    LN2,
    LOG2E,
    SAMPLING_EPS,
    argmax2d,
    finite_count,
    gumbel,
    key,
    load_row_params,
    process_tile,
    row_search,
    search_list,
    select_candidates,
    unkey,
)

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logits", "processed_logprobs")
_MODE_CODE = {
    None: 0,
    "raw_logprobs": 1,
    "raw_logits": 2,
    "processed_logits": 3,
    "processed_logprobs": 4,
}
MAX_LOGPROBS = 128  # top-n beyond this is left to vLLM's own path

# Launch configuration, measured on an H100 (benchmarks/results/
# sampling-h100-80gb-hbm3-2026-11-25-sweep.json, T=0.7 k=50 p=0.9, fp32 logits; us for
# (chunk, chunk-kernel warps, register cap)): B=1 V=128256 (4096, 8) 23.4, (2048, 4) 23.7,
# (2048, 8) 24.7; B=32 (2048, 4) 34.4, (4096, 8) 35.5, (1024, 4) 43.0; B=256 V=151936
# (4096, 4) 128.2, (4096, 4, cap 128) 135.9, (2048, 4) 145.8, (4096, 8) 157.6; B=256 with
# penalties + min-p (4096, 4, cap 128) 211.0, (4096, 4) 248.0, (2048, 4) 247.8. The chunk
# kernel keeps a chunk in registers (119 registers at 4 warps: four programs per SM); the
# penalties push it to 167 (three per SM) unless capped at 128 (four per SM, 16 bytes of
# spills), which wins. So: a grid of at most one program per SM keeps whole 4096-chunks at
# 8 warps (B=1: 32 programs); up to SMALL_CHUNK_PROGRAMS programs use 2048-chunks at 4 warps;
# larger grids 4096-chunks at 4 warps, capped at 128 registers when penalties are on.
# Penalties written in place (logits_writable) take the plain rule: the in-place sweep of
# benchmarks/results/sampling-h100-80gb-hbm3-2026-11-25-fused-walk-sweep.json measured
# B=256 (4096, 4) 163.6, (2048, 4) 198.9, (4096, 4, cap 128) 204.9, (4096, 8) 224.9;
# B=32 (2048, 4) 39.4, (4096, 8) 40.2, (1024, 4) 51.3; B=1 (4096, 8) 25.1, (2048, 4) 25.0.
CHUNK_SMALL = 2048
CHUNK_LARGE = 4096
ONE_WAVE_PROGRAMS = 132
SMALL_CHUNK_PROGRAMS = 2048
LARGE_GRID_WARPS = 4
LARGE_GRID_MAXNREG_PEN = 128
MIN_CHUNK = 128
COMBINE_MAXNREG = 128
CAP = 64  # candidates kept per chunk; rows whose kept set does not fit take the exact fallback
FB_TILE = 256  # fallback pass tile (elements)
SURVIVORS = 64  # top-k / min-p survivors gathered for top-p and the draw (else list searches)
FB_PIVOTS = 16  # fallback key search: pivots per pass (4 bits of the key per pass)
BIAS_BLOCK = 16  # logit-bias entries loaded per step

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_KEY_NEG_INF = tl.constexpr(KEY_NEG_INF)
_KEY_NO_BOUND = tl.constexpr(KEY_NO_BOUND)
_INT64_MIN = tl.constexpr(-(2**63))
# an empty candidate slot: fp32 bits of -inf (0xFF800000 as int32) << 32, token 0
_EMPTY = tl.constexpr(-(0x00800000 << 32))


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sample_chunk_kernel(
    logits_ptr,
    stride_row,
    V,
    NC,
    PLANE,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    slots_ptr,
    pmask_ptr,
    pmask_stride,
    counts_ptr,
    counts_stride,
    omask_ptr,
    omask_stride,
    bcount_ptr,
    btok_ptr,
    bval_ptr,
    b_stride,
    seeds_ptr,
    has_seed_ptr,
    rseeds_ptr,
    offsets_ptr,
    stf_ptr,
    sti_ptr,
    cand_ptr,
    rcand_ptr,
    CHUNK: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    PEN_IN_PLACE: tl.constexpr,
    BIT_STEPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    NEED_RAW: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """Per-chunk partials. Grid (NC, B); program (c, b) reads logits[b, c*CHUNK:(c+1)*CHUNK]
    once (logits: [B, V] fp32/bf16/fp16, stride 1 in V; parameters as in fused_sample).

    Writes at flat index i = b*NC + c, planes of PLANE entries: stf (fp32) 0 zmax,
    1 sum exp(z - zmax), 2 floor, 3 raw max, 4 raw sum exp(x - raw max), 5 raw floor,
    6 Gumbel winner score, 7 winner z; sti (int32) 0 candidate count, 1 raw candidate count,
    2 NaN count, 3 winner token, 4 finite z count, 5 finite raw count. Candidates:
    cand[i*CAP + j] int64 key(z) << 32 | token, in token order (rcand: raw values).
    """
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    Q: tl.constexpr = CHUNK // 4
    (
        greedy,
        t_eff,
        _k,
        k_on,
        _p,
        p_on,
        _minp,
        minp_on,
        rep,
        freq,
        pres,
        use_pen,
        slot,
        nbias,
        h,
    ) = load_row_params(
        row,
        V,
        temp_ptr,
        topk_ptr,
        topp_ptr,
        minp_ptr,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        slots_ptr,
        bcount_ptr,
        seeds_ptr,
        has_seed_ptr,
        rseeds_ptr,
        offsets_ptr,
        HAS_TEMP,
        EXACT,
        HAS_TOPK,
        HAS_TOPP,
        HAS_MINP,
        HAS_REP,
        HAS_FREQ,
        HAS_PRES,
        HAS_SLOTS,
        HAS_BIAS,
        SEED_MODE,
        HAS_OFFSETS,
    )
    start = c.to(tl.int64) * CHUNK
    idx = row * NC + c
    if PEN_IN_PLACE:
        if use_pen:
            penalize_words(
                logits_ptr + row * stride_row,
                counts_ptr + slot * counts_stride,
                pmask_ptr + slot * pmask_stride,
                omask_ptr + slot * omask_stride,
                c * (CHUNK // 32),  # packed words of 32 tokens
                V,
                rep,
                freq,
                pres,
                CHUNK // 32,
                HAS_OUT_MASK,
                BIT_STEPS,
                EXACT,
            )
        tl.debug_barrier()  # every rewritten token stored before the chunk is read
    _tok, x, z, is_nan = process_tile(
        start,
        row,
        slot,
        logits_ptr,
        stride_row,
        V,
        t_eff,
        rep,
        freq,
        pres,
        use_pen,
        nbias,
        pmask_ptr,
        pmask_stride,
        counts_ptr,
        counts_stride,
        omask_ptr,
        omask_stride,
        btok_ptr,
        bval_ptr,
        b_stride,
        Q,
        HAS_TEMP,
        EXACT,
        HAS_BIAS,
        HAS_PEN,
        HAS_OUT_MASK,
        BIAS_BLOCK,
    )
    qmax = tl.max(z, axis=1)  # in-thread maxima of the 4-token rows [Q]
    zmax = tl.max(qmax, axis=0)
    # sum exp(z - zmax) = sum 2^(z*log2e - zmax*log2e); -inf values give 0
    zsum = tl.sum(tl.sum(tl.exp2(z * _LOG2E - zmax * _LOG2E), axis=1), axis=0)
    zsum = tl.where(zmax > float("-inf"), zsum, 0.0)
    n_fin = finite_count(z)
    n_nan = tl.full((), 0, tl.int32)
    if n_fin < 4 * Q:  # NaN became -inf: only a chunk with a non-finite value can hold one
        n_nan = tl.sum(tl.sum(is_nan.to(tl.int32), axis=1), axis=0)
    cnt, floor = select_candidates(
        qmax,
        zmax,
        start,
        cand_ptr + idx * CAP,
        False,
        row,
        slot,
        logits_ptr,
        stride_row,
        V,
        t_eff,
        rep,
        freq,
        pres,
        use_pen,
        nbias,
        pmask_ptr,
        pmask_stride,
        counts_ptr,
        counts_stride,
        omask_ptr,
        omask_stride,
        btok_ptr,
        bval_ptr,
        b_stride,
        Q,
        CAP,
        HAS_TEMP,
        EXACT,
        HAS_BIAS,
        HAS_PEN,
        HAS_OUT_MASK,
        BIAS_BLOCK,
    )
    tl.store(stf_ptr + 0 * PLANE + idx, zmax)
    tl.store(stf_ptr + 1 * PLANE + idx, zsum)
    tl.store(stf_ptr + 2 * PLANE + idx, floor)
    tl.store(sti_ptr + 0 * PLANE + idx, cnt)
    tl.store(sti_ptr + 2 * PLANE + idx, n_nan)
    tl.store(sti_ptr + 4 * PLANE + idx, n_fin)
    if NEED_RAW:
        xmax = tl.max(x, axis=1)
        rmax = tl.max(xmax, axis=0)
        rsum = tl.sum(tl.sum(tl.exp2(x * _LOG2E - rmax * _LOG2E), axis=1), axis=0)
        tl.store(stf_ptr + 3 * PLANE + idx, rmax)
        tl.store(stf_ptr + 4 * PLANE + idx, tl.where(rmax > float("-inf"), rsum, 0.0))
        tl.store(sti_ptr + 5 * PLANE + idx, finite_count(x))
        if RAW_CANDS:
            rcnt, rfloor = select_candidates(
                xmax,
                rmax,
                start,
                rcand_ptr + idx * CAP,
                True,
                row,
                slot,
                logits_ptr,
                stride_row,
                V,
                t_eff,
                rep,
                freq,
                pres,
                use_pen,
                nbias,
                pmask_ptr,
                pmask_stride,
                counts_ptr,
                counts_stride,
                omask_ptr,
                omask_stride,
                btok_ptr,
                bval_ptr,
                b_stride,
                Q,
                CAP,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            tl.store(stf_ptr + 5 * PLANE + idx, rfloor)
            tl.store(sti_ptr + 1 * PLANE + idx, rcnt)
    # Rows without any truncation draw here: Gumbel argmax over every finite value. The chunk
    # is re-read in sub-tiles (L2 hits) so this path holds no registers across the code above.
    untrunc = (~greedy) & (~k_on) & (~p_on) & (~minp_on)
    wscore = tl.full((), float("-inf"), tl.float32)
    wz = tl.full((), float("-inf"), tl.float32)
    widx = start.to(tl.int32)
    if untrunc:
        for s0 in range(0, CHUNK, SUB):
            stok, _sx, sz, _sn = process_tile(
                start + s0,
                row,
                slot,
                logits_ptr,
                stride_row,
                V,
                t_eff,
                rep,
                freq,
                pres,
                use_pen,
                nbias,
                pmask_ptr,
                pmask_stride,
                counts_ptr,
                counts_stride,
                omask_ptr,
                omask_stride,
                btok_ptr,
                bval_ptr,
                b_stride,
                SUB // 4,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            sc = tl.where(sz > float("-inf"), sz + gumbel(h, stok), float("-inf"))
            bv, bp = argmax2d(sc)
            if bv > wscore:
                wscore = bv
                widx = start.to(tl.int32) + s0 + bp
                wz = tl.max(tl.max(tl.where(stok == widx, sz, float("-inf")), axis=1), axis=0)
    tl.store(stf_ptr + 6 * PLANE + idx, wscore)
    tl.store(stf_ptr + 7 * PLANE + idx, wz)
    tl.store(sti_ptr + 3 * PLANE + idx, widx)


@triton.jit
def _pick(ar, pos, vals):
    """vals[pos] of a 1-D tensor (0 if pos is out of range)."""
    return tl.sum(tl.where(ar == pos, vals, 0), axis=0)


@triton.jit(do_not_specialize=["NUM_LOGPROBS"])
def _sample_combine_kernel(
    logits_ptr,
    stride_row,
    V,
    NC,
    PLANE,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    slots_ptr,
    pmask_ptr,
    pmask_stride,
    counts_ptr,
    counts_stride,
    omask_ptr,
    omask_stride,
    bcount_ptr,
    btok_ptr,
    bval_ptr,
    b_stride,
    seeds_ptr,
    has_seed_ptr,
    rseeds_ptr,
    offsets_ptr,
    stf_ptr,
    sti_ptr,
    cand_ptr,
    rcand_ptr,
    out_tok_ptr,
    out_lp_ptr,
    out_ids_ptr,
    out_tlp_ptr,
    out_nan_ptr,
    out_thr_ptr,
    out_kept_ptr,
    out_fb_ptr,
    scratch_ptr,
    NUM_LOGPROBS,
    NC_PAD: tl.constexpr,
    CAP: tl.constexpr,
    MODE: tl.constexpr,
    TP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    TOPN: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
    NP: tl.constexpr,
    FB_TILE: tl.constexpr,
    KC: tl.constexpr,
):
    """Per-row merge of the chunk partials; grid (B,). Outputs for row b: out_tok[b] int64,
    out_lp[b] fp32 (MODE > 0), out_ids[b*n:(b+1)*n] int64 and out_tlp[...] fp32 (TOPN),
    out_nan[b] int32, out_thr[b] fp32 (kept = finite z >= thr), out_kept[b] int32,
    out_fb[b] int32 (1: exact fallback drew the token, 2: it built the top-n).
    MODE: 0 none, 1 raw_logprobs, 2 raw_logits, 3 processed_logits, 4 processed_logprobs.
    """
    row = tl.program_id(0).to(tl.int64)
    NCAND: tl.constexpr = NC_PAD * CAP
    LIST_TOPN: tl.constexpr = NCAND >= TP  # tl.topk needs k <= n
    RAW_TOPN: tl.constexpr = MODE == 1 or MODE == 2
    (greedy, t_eff, k, k_on, p, p_on, minp, minp_on, rep, freq, pres, use_pen, slot, nbias, h) = (
        load_row_params(
            row,
            V,
            temp_ptr,
            topk_ptr,
            topp_ptr,
            minp_ptr,
            rep_ptr,
            freq_ptr,
            pres_ptr,
            slots_ptr,
            bcount_ptr,
            seeds_ptr,
            has_seed_ptr,
            rseeds_ptr,
            offsets_ptr,
            HAS_TEMP,
            EXACT,
            HAS_TOPK,
            HAS_TOPP,
            HAS_MINP,
            HAS_REP,
            HAS_FREQ,
            HAS_PRES,
            HAS_SLOTS,
            HAS_BIAS,
            SEED_MODE,
            HAS_OFFSETS,
        )
    )
    masked = k_on | p_on | minp_on

    # ---- chunk partials -> row statistics
    cs = tl.arange(0, NC_PAD)
    cm = cs < NC
    sb = row * NC
    zmax_c = tl.load(stf_ptr + 0 * PLANE + sb + cs, mask=cm, other=float("-inf"))
    zsum_c = tl.load(stf_ptr + 1 * PLANE + sb + cs, mask=cm, other=0.0)
    floor_c = tl.load(stf_ptr + 2 * PLANE + sb + cs, mask=cm, other=float("-inf"))
    cnt_c = tl.load(sti_ptr + 0 * PLANE + sb + cs, mask=cm, other=0)
    m = tl.max(zmax_c, axis=0)
    has_fin = m > float("-inf")
    # Z = sum_c zsum_c * exp(zmax_c - m): softmax normaliser of z relative to m
    Z = tl.sum(
        tl.where(zmax_c > float("-inf"), zsum_c * tl.exp2((zmax_c - m) * _LOG2E), 0.0), axis=0
    )
    kF = key(tl.max(floor_c, axis=0)).to(tl.int64)
    complete = kF == _KEY_NEG_INF  # no finite value was left out of any chunk's list
    nfin = tl.sum(tl.load(sti_ptr + 4 * PLANE + sb + cs, mask=cm, other=0), axis=0)
    nnan = tl.sum(tl.load(sti_ptr + 2 * PLANE + sb + cs, mask=cm, other=0), axis=0)
    km = key(m).to(tl.int64)
    # min-p bound (V2): keep z >= m + log(min_p)
    kmin = tl.where(
        minp_on, key(m + tl.log(tl.where(minp_on, minp, 1.0))).to(tl.int64), _KEY_NO_BOUND
    )

    # ---- the row's candidate list, flattened in token order
    sl = tl.arange(0, CAP)
    cvalid = cm[:, None] & (sl[None, :] < cnt_c[:, None])
    cptr = (sb + cs)[:, None] * CAP + sl[None, :]
    packed = tl.reshape(tl.load(cand_ptr + cptr, mask=cvalid, other=_EMPTY), [NCAND])
    cz = (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    ci = (packed & 0xFFFFFFFF).to(tl.int32)
    ck = key(cz)
    fvalid = tl.reshape(cvalid, [NCAND])
    ar = tl.arange(0, NCAND)
    e = tl.exp2((cz - m) * _LOG2E)  # exp(z - m); empty slots hold -inf -> 0

    # ---- thresholds and draw from the lists (exact when the kept set lies above every floor)
    fb = tl.full((), 0, tl.int32)
    tau = tl.full((), _KEY_NO_BOUND, tl.int64)
    tok = tl.full((), 0, tl.int64)
    ztok = tl.full((), float("-inf"), tl.float32)
    Ztau = Z
    kept = nfin
    if has_fin:
        if (~greedy) & (~masked):
            # untruncated random row: the chunks drew already; take the best chunk winner
            ws_c = tl.load(stf_ptr + 6 * PLANE + sb + cs, mask=cm, other=float("-inf"))
            wz_c = tl.load(stf_ptr + 7 * PLANE + sb + cs, mask=cm, other=0.0)
            wi_c = tl.load(sti_ptr + 3 * PLANE + sb + cs, mask=cm, other=0)
            bv, bc = tl.max(ws_c, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tok = _pick(cs, bc, wi_c).to(tl.int64)
            ztok = _pick(cs, bc, wz_c)
        elif ~masked:
            # greedy without masks: the first listed value with key(m), if all maxima are listed
            if km > kF:
                _bk, bpos = tl.max(
                    ck, axis=0, return_indices=True, return_indices_tie_break_left=True
                )
                tok = _pick(ar, bpos, ci).to(tl.int64)
                ztok = m
            else:
                fb = 1
        else:
            lb = kmin
            if k_on & (nfin > k):
                if tl.sum((ck > kF).to(tl.int32), axis=0) >= k:
                    kth = search_list(ck, 1.0, k.to(tl.float32), kF + 1, km + 1, True)
                    lb = tl.maximum(lb, kth)
                else:
                    fb = 1
            if (lb != _KEY_NO_BOUND) & (lb <= kF) & (~complete):
                fb = 1  # a lower bound the lists do not cover
            # Few survivors of top-k / min-p (the usual k): they are gathered into KC slots
            # (the row's own list region, already read), so top-p compares each survivor with
            # the others instead of searching, and only they draw noise.
            surv = ck >= lb
            n_surv = tl.sum(surv.to(tl.int32), axis=0)
            if (fb == 0) & (lb != _KEY_NO_BOUND) & (n_surv <= KC):
                rbase = cand_ptr + sb * CAP
                tl.debug_barrier()  # every thread has read the list before the region is reused
                tl.store(rbase + tl.cumsum(surv.to(tl.int32), axis=0) - 1, packed, mask=surv)
                tl.debug_barrier()
                jj = tl.arange(0, KC)
                jv = jj < n_surv
                sv = tl.load(rbase + jj, mask=jv, other=_EMPTY)
                sz = (sv >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                si = (sv & 0xFFFFFFFF).to(tl.int32)
                sk = key(sz)
                se = tl.exp2((sz - m) * _LOG2E)
                tau = lb
                if p_on:
                    # mass of the survivors at or above each survivor's key
                    mass = tl.sum(tl.where(sk[None, :] >= sk[:, None], se[None, :], 0.0), axis=1)
                    target = p * tl.max(mass, axis=0)
                    top_key = tl.max(tl.where(jv & (mass >= target), sk, _KEY_NO_BOUND), axis=0)
                    tau = tl.maximum(tau, top_key.to(tl.int64))
                keep_s = jv & (sk >= tau)
                Ztau = tl.sum(tl.where(keep_s, se, 0.0), axis=0)
                kept = tl.sum(keep_s.to(tl.int32), axis=0)
                sc = tl.where(keep_s, sz + tl.where(greedy, 0.0, gumbel(h, si)), float("-inf"))
                bv, bpos = tl.max(
                    sc, axis=0, return_indices=True, return_indices_tie_break_left=True
                )
                tok = _pick(jj, bpos, si).to(tl.int64)
                ztok = _pick(jj, bpos, sz)
            else:
                tau = lb
                if (fb == 0) & p_on:
                    eL = tl.where(ck >= lb, e, 0.0)
                    ZL = tl.where(lb == _KEY_NO_BOUND, Z, tl.sum(eL, axis=0))
                    target = p * ZL
                    lo0 = tl.maximum(lb, kF + 1)
                    if tl.sum(tl.where(ck >= lo0, eL, 0.0), axis=0) >= target:
                        tau = tl.maximum(tau, search_list(ck, eL, target, lo0, km + 1, False))
                    elif ~complete:
                        fb = 1
                if (fb == 0) & (tau <= kF) & (~complete):
                    fb = 1  # the kept set reaches below a chunk floor
                if fb == 0:
                    keep = ck >= tau
                    Ztau = tl.sum(tl.where(keep, e, 0.0), axis=0)
                    kept = tl.sum(keep.to(tl.int32), axis=0)
                    noise = gumbel(h, ci)
                    sc = tl.where(keep, cz + tl.where(greedy, 0.0, noise), float("-inf"))
                    bv, bpos = tl.max(
                        sc, axis=0, return_indices=True, return_indices_tie_break_left=True
                    )
                    tok = _pick(ar, bpos, ci).to(tl.int64)
                    ztok = _pick(ar, bpos, cz)

    # ---- raw softmax statistics (raw modes)
    mr = tl.full((), float("-inf"), tl.float32)
    log_sr = tl.full((), 0.0, tl.float32)
    if RAW_TOPN:
        rmax_c = tl.load(stf_ptr + 3 * PLANE + sb + cs, mask=cm, other=float("-inf"))
        rsum_c = tl.load(stf_ptr + 4 * PLANE + sb + cs, mask=cm, other=0.0)
        mr = tl.max(rmax_c, axis=0)
        Sr = tl.sum(
            tl.where(rmax_c > float("-inf"), rsum_c * tl.exp2((rmax_c - mr) * _LOG2E), 0.0), axis=0
        )
        log_sr = tl.log2(Sr) * _LN2

    # ---- top-n from the lists when they cover it
    n_lp = NUM_LOGPROBS
    top = tl.full([TP], _INT64_MIN, tl.int64)
    topn_fb = tl.full((), 0, tl.int1)
    vmax_n = m
    nfin_n = nfin
    if TOPN:
        if RAW_TOPN:
            if RAW_CANDS:
                rcnt_c = tl.load(sti_ptr + 1 * PLANE + sb + cs, mask=cm, other=0)
                rvalid = cm[:, None] & (sl[None, :] < rcnt_c[:, None])
                rpacked = tl.reshape(tl.load(rcand_ptr + cptr, mask=rvalid, other=_EMPTY), [NCAND])
                lv = (rpacked >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                li = (rpacked & 0xFFFFFFFF).to(tl.int32)
                lk = key(lv)
                rfloor_c = tl.load(stf_ptr + 5 * PLANE + sb + cs, mask=cm, other=float("-inf"))
                lF = key(tl.max(rfloor_c, axis=0)).to(tl.int64)
                list_ok = (lF == _KEY_NEG_INF) | (tl.sum((lk > lF).to(tl.int32), axis=0) >= n_lp)
            else:
                # The z list ranked by raw value: without bias and penalties z is a monotone
                # function of x, so every value outside it is below every listed value whose
                # z is above the z floor.
                lv = tl.load(
                    logits_ptr + row * stride_row + ci, mask=fvalid, other=float("-inf")
                ).to(tl.float32)
                li = ci
                lk = key(lv)
                list_ok = complete | (tl.sum((ck > kF).to(tl.int32), axis=0) >= n_lp)
            lvalid = lv > float("-inf")
            nfin_n = tl.sum(tl.load(sti_ptr + 5 * PLANE + sb + cs, mask=cm, other=0), axis=0)
            vmax_n = mr
        else:
            li = ci
            lk = ck
            lvalid = fvalid
            list_ok = complete | (tl.sum((ck > kF).to(tl.int32), axis=0) >= n_lp)
        if LIST_TOPN:
            if list_ok & has_fin:
                ranked = tl.where(
                    lvalid, (lk.to(tl.int64) << 32) | (0x7FFFFFFF - li.to(tl.int64)), _INT64_MIN
                )
                top = tl.topk(ranked, TP)
            else:
                topn_fb = has_fin
        else:
            topn_fb = has_fin

    # ---- exact fallback: searches with passes over the row (one call site for all of them)
    if (fb != 0) | topn_fb:
        lb = tl.full((), _KEY_NO_BOUND, tl.int64)
        tp = tl.full((), _KEY_NO_BOUND, tl.int64)
        tn = tl.full((), _KEY_NO_BOUND, tl.int64)
        kmax_n = key(vmax_n).to(tl.int64)
        for job in range(0, 3):
            # job 0: top-k (count), 1: top-p (mass, relative to the top-k/min-p survivors),
            # 2: n-th best value for the top-n
            run0 = (job == 0) & (fb != 0) & k_on & (nfin > k)
            run1 = (job == 1) & (fb != 0) & p_on
            run2 = (job == 2) & topn_fb & (nfin_n > n_lp)
            lbp = tl.maximum(lb, kmin)
            if run0 | run1 | run2:
                frac = tl.where(run0, k.to(tl.float32), tl.where(run1, p, n_lp + 0.0))
                lo = tl.where(run1, lbp, _KEY_NO_BOUND)
                hi = tl.where(run2, kmax_n + 1, km + 1)
                bound = tl.where(run1, lbp, _KEY_NO_BOUND).to(tl.int32)
                res = row_search(
                    frac,
                    lo,
                    hi,
                    bound,
                    tl.where(run2, vmax_n, m),
                    run1,
                    run2 & RAW_TOPN,
                    row,
                    slot,
                    logits_ptr,
                    stride_row,
                    V,
                    t_eff,
                    rep,
                    freq,
                    pres,
                    use_pen,
                    nbias,
                    pmask_ptr,
                    pmask_stride,
                    counts_ptr,
                    counts_stride,
                    omask_ptr,
                    omask_stride,
                    btok_ptr,
                    bval_ptr,
                    b_stride,
                    NP,
                    FB_TILE,
                    HAS_TEMP,
                    EXACT,
                    HAS_BIAS,
                    HAS_PEN,
                    HAS_OUT_MASK,
                    BIAS_BLOCK,
                )
                lb = tl.where(run0, res, lb)
                tp = tl.where(run1, res, tp)
                tn = tl.where(run2, res, tn)
        if fb != 0:
            tau = tl.maximum(lb, kmin)
            if p_on:
                tau = tl.maximum(tau, tp)
            Ztau = tl.full((), 0.0, tl.float32)
            kept = tl.full((), 0, tl.int32)
        # one pass: draw (kept mass, count, argmax of z + noise over z >= tau) and/or collect
        # the top-n (values above tn, fewer than n, plus the first TP ties at tn)
        best = tl.full((), float("-inf"), tl.float32)
        n_strict = tl.full((), 0, tl.int32)
        n_tie = tl.full((), 0, tl.int32)
        sbase = scratch_ptr + row * (2 * TP)
        for s0 in range(0, V, FB_TILE):
            tile_tok, x, z, _is_nan = process_tile(
                s0 + tl.zeros((), dtype=tl.int64),
                row,
                slot,
                logits_ptr,
                stride_row,
                V,
                t_eff,
                rep,
                freq,
                pres,
                use_pen,
                nbias,
                pmask_ptr,
                pmask_stride,
                counts_ptr,
                counts_stride,
                omask_ptr,
                omask_stride,
                btok_ptr,
                bval_ptr,
                b_stride,
                FB_TILE // 4,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            z1 = tl.reshape(z, [FB_TILE])
            t1 = tl.reshape(tile_tok, [FB_TILE])
            if fb != 0:
                keep = (z1 > float("-inf")) & (key(z1) >= tau)
                Ztau += tl.sum(tl.where(keep, tl.exp2((z1 - m) * _LOG2E), 0.0), axis=0)
                kept += tl.sum(keep.to(tl.int32), axis=0)
                sc = tl.where(keep, z1 + tl.where(greedy, 0.0, gumbel(h, t1)), float("-inf"))
                bv, bp = tl.max(sc, axis=0, return_indices=True, return_indices_tie_break_left=True)
                if bv > best:
                    best = bv
                    tok = s0 + bp.to(tl.int64)
                    ztok = tl.sum(tl.where(tl.arange(0, FB_TILE) == bp, z1, 0.0), axis=0)
            if TOPN:
                if topn_fb:
                    if RAW_TOPN:
                        v1 = tl.reshape(x, [FB_TILE])
                    else:
                        v1 = z1
                    kv = key(v1)
                    okv = v1 > float("-inf")
                    strict = okv & (kv > tn)
                    tie = okv & (kv == tn)
                    pk = (kv.to(tl.int64) << 32) | (0x7FFFFFFF - t1.to(tl.int64))
                    ps = n_strict + tl.cumsum(strict.to(tl.int32), axis=0) - 1
                    tl.store(sbase + ps, pk, mask=strict)
                    pt = n_tie + tl.cumsum(tie.to(tl.int32), axis=0) - 1
                    tl.store(sbase + TP + pt, pk, mask=tie & (pt < TP))
                    n_strict += tl.sum(strict.to(tl.int32), axis=0)
                    n_tie += tl.sum(tie.to(tl.int32), axis=0)
        if TOPN:
            if topn_fb:
                tl.debug_barrier()  # this program's scratch stores before its loads
                a2 = tl.arange(0, 2 * TP)
                avalid = tl.where(a2 < TP, a2 < n_strict, (a2 - TP) < n_tie)
                top = tl.topk(tl.load(sbase + a2, mask=avalid, other=_INT64_MIN), TP)

    # ---- outputs
    log_z = tl.log2(Ztau) * _LN2
    if MODE != 0:
        if RAW_TOPN:
            xt = tl.load(logits_ptr + row * stride_row + tok).to(tl.float32)
            xt = tl.where(xt != xt, float("-inf"), xt)
            if MODE == 1:
                lp = tl.where(mr > float("-inf"), xt - mr - log_sr, float("-inf"))
            else:
                lp = xt
        elif MODE == 3:
            lp = ztok
        else:
            lp = tl.where(has_fin, ztok - m - log_z, float("-inf"))
        tl.store(out_lp_ptr + row, lp)
    if TOPN:
        # top: sorted descending, key << 32 | (2^31 - 1 - id), INT64_MIN = empty
        valid = top != _INT64_MIN
        tkey = (top >> 32).to(tl.int32)
        ids = tl.where(valid, 0x7FFFFFFF - (top & 0xFFFFFFFF), -1)
        j = tl.arange(0, TP)
        wmask = j < n_lp
        if RAW_TOPN:
            xv = tl.load(
                logits_ptr + row * stride_row + tl.maximum(ids, 0),
                mask=valid & wmask,
                other=float("-inf"),
            ).to(tl.float32)
            if MODE == 1:
                val = xv - mr - log_sr
            else:
                val = xv
        else:
            zv = unkey(tkey)
            kept_j = tkey >= tau
            if MODE == 3:
                val = tl.where(kept_j, zv, float("-inf"))
            else:
                val = tl.where(kept_j, zv - m - log_z, float("-inf"))
        val = tl.where(valid, val, float("-inf"))
        tl.store(out_ids_ptr + row * n_lp + j, ids, mask=wmask)
        tl.store(out_tlp_ptr + row * n_lp + j, val, mask=wmask)

    tl.store(out_tok_ptr + row, tok)
    tl.store(out_nan_ptr + row, nnan)
    thr = tl.where(tau == _KEY_NO_BOUND, float("-inf"), unkey(tau.to(tl.int32)))
    tl.store(out_thr_ptr + row, tl.where(has_fin, thr, float("inf")))
    tl.store(out_kept_ptr + row, tl.where(has_fin, kept, 0))
    tl.store(out_fb_ptr + row, fb + 2 * topn_fb.to(tl.int32))


# ---------------------------------------------------------------------------------------------
# Host side: parameters, workspace, launcher
# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingParamsTensors:
    """Per-row sampling parameters as device tensors; None turns a step off for the whole batch.

    Per row ([B]): temperature fp32 (< 1e-5 = greedy; None = 1.0 for every row), top_k int32/64
    (<= 0 or >= V = off), top_p fp32 (>= 1 = off), min_p fp32 (0 = off), repetition_penalty /
    frequency_penalty / presence_penalty fp32 (1 / 0 / 0 = off; None = off), seeds int64,
    has_seed bool (None with seeds given: every row is seeded), seed_offsets int64 (the position
    the draw is for: vLLM V2 passes the token position; None = 0).

    Per request slot (vLLM V2's layout; `state_slots [B]` int32/64 maps a row to its slot,
    None = row b uses slot b): prompt_bin_mask [S, ceil(V/32)] int32 (bit t%32 of word t/32 set
    when token t is in the prompt), output_bin_counts [S, V] int32, output_bin_mask
    [S, ceil(V/32)] int32 (optional: presence bits of the output tokens; when given, counts are
    read only where a bit is set, which saves a dense read of the counts), logit_bias_counts [S]
    int32 with logit_bias_token_ids [S, NB] int32 and logit_bias_values [S, NB] fp32 (the first
    count entries of the slot's lists; any order). `penalty_state_from_v1` and
    `logit_bias_from_dicts` build these from vLLM V1's forms.
    """

    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    prompt_bin_mask: torch.Tensor | None = None
    output_bin_counts: torch.Tensor | None = None
    output_bin_mask: torch.Tensor | None = None
    logit_bias_counts: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    has_seed: torch.Tensor | None = None
    seed_offsets: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return any(
            t is not None
            for t in (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        )

    @property
    def has_bias(self) -> bool:
        return self.logit_bias_counts is not None


@dataclass
class SampleOutput:
    """token_ids [B] int64; logprob [B] fp32 (None when logprobs were not asked for);
    topn_ids [B, n] int64 (-1 = padding) and topn_logprobs [B, n] fp32 (None when n = 0);
    nan_rows [B] int32 (NaN logits per row). Diagnostics: kept_count [B] int32 (tokens that
    survived min-p/top-k/top-p), kept_threshold [B] fp32 (kept = finite processed values >=
    it), fallback_rows [B] int32 (kernel only: 1 = exact row-pass fallback for the draw,
    2 = for top-n)."""

    token_ids: torch.Tensor
    logprob: torch.Tensor | None
    topn_ids: torch.Tensor | None
    topn_logprobs: torch.Tensor | None
    nan_rows: torch.Tensor
    kept_count: torch.Tensor | None = None
    kept_threshold: torch.Tensor | None = None
    fallback_rows: torch.Tensor | None = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Widths of the combine kernel's top-n list (TP, powers of two): a request for n logprobs runs
# the narrowest that holds n, so a serving run meets at most these few combine-kernel variants
# (a width per power of two had vLLM compile one mid-serving for the first logprobs=5 batch
# after start-up compiled another). None below 2: Triton 3.6's `tl.topk(x, 1)` does not
# compile for the GPU (its last merge step reduces the list to a scalar and the reshape after
# it fails). The widest, MAX_LOGPROBS, costs the most per row: only requests above 32 use it.
TOPN_WIDTHS = (8, 32, MAX_LOGPROBS)


def _topn_width(num_logprobs: int) -> int:
    """The top-n list width for `num_logprobs` (<= MAX_LOGPROBS; 0 gets the narrowest)."""
    return next(w for w in TOPN_WIDTHS if w >= num_logprobs)


def chunk_warps_for(chunk: int) -> int:
    """Warps that give the chunk kernel 16 fp32 values per thread (1 to 16)."""
    return max(1, min(16, chunk // 512))


def pick_launch(batch: int, vocab: int, *, penalties: bool = False) -> tuple[int, int, int]:
    """(chunk, chunk-kernel warps, register cap or 0) for a batch (see the launch-configuration
    note): one chunk for small vocabularies; whole 4096-chunks at 8 warps while the grid is
    within one program per SM; 2048-chunks at 4 warps up to SMALL_CHUNK_PROGRAMS programs;
    else 4096-chunks at 4 warps, with a 128-register cap when penalties are on. The chunk
    does not depend on `penalties`."""
    if vocab <= CHUNK_LARGE:
        chunk = max(MIN_CHUNK, _next_pow2(vocab))
        return chunk, chunk_warps_for(chunk), 0
    if batch * cdiv(vocab, CHUNK_LARGE) <= ONE_WAVE_PROGRAMS:
        return CHUNK_LARGE, 8, 0
    if batch * cdiv(vocab, CHUNK_SMALL) <= SMALL_CHUNK_PROGRAMS:
        return CHUNK_SMALL, 4, 0
    return CHUNK_LARGE, LARGE_GRID_WARPS, LARGE_GRID_MAXNREG_PEN if penalties else 0


def pick_chunk(batch: int, vocab: int) -> int:
    """The chunk size pick_launch chooses."""
    return pick_launch(batch, vocab)[0]


# The roundings a workspace can ask for (SamplingWorkspace.allocate's `arith`), default first.
ARITH_MODES = ("triton", "torch")


class SamplingWorkspace:
    """Fixed device scratch and outputs for `fused_sample`, sized once for (max_batch, vocab).

    Reusing one workspace keeps the hot call free of allocations (CUDA-graph safe). The returned
    SampleOutput tensors are views into it: the next call overwrites them.
    """

    def __init__(self) -> None:  # use allocate()
        self.max_batch = 0

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        vocab: int,
        device: torch.device | str,
        *,
        max_logprobs: int = 20,
        chunk: int | None = None,
        cap: int = CAP,
        chunk_warps: int | None = None,
        maxnreg: int | None = None,
        arith: str = "triton",
    ) -> SamplingWorkspace:
        """chunk, cap, chunk_warps (warps of the chunk kernel) and maxnreg (its register cap;
        both apply only with chunk) override the launch rule: tests use tiny chunk/cap to
        exercise every path, the benchmark's --sweep times alternatives.

        arith: the rounding of temperature and penalties on a GPU (`sampling_penalties.div`):
        "triton" (Triton's own fp32 arithmetic, div.full.f32 and fused multiply-adds, as vLLM
        V2's sampler kernels compute) or "torch" (IEEE division and each product rounded, as
        the references and vLLM's V1 sampler compute; 8-40% slower at B=32-256 on an H200,
        sampling-arith-torch-h200-2026-11-26.json against sampling-h200-2026-11-26.json). The
        two differ by at most 2 ulp per value, and not at all under Triton's interpreter."""
        check_choice("arith", arith, ARITH_MODES)
        if max_batch < 1 or vocab < 1:
            raise ValueError(f"max_batch and vocab: expected >= 1, got {max_batch}, {vocab}")
        if not 0 <= max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs: expected a value in [0, {MAX_LOGPROBS}], got {max_logprobs}"
            )
        if chunk is not None and (chunk < MIN_CHUNK or chunk & (chunk - 1)):
            raise ValueError(f"chunk: expected a power of two >= {MIN_CHUNK}, got {chunk}")
        if cap < 2 or cap & (cap - 1):
            raise ValueError(f"cap: expected a power of two >= 2, got {cap}")
        ws = cls()
        device = torch.device(device)
        ws.device, ws.max_batch, ws.vocab = device, max_batch, vocab
        ws.max_logprobs, ws.chunk, ws.cap = max_logprobs, chunk, cap
        ws.chunk_warps, ws.maxnreg = chunk_warps or 0, maxnreg or 0
        ws.arith = arith
        # Planes hold one entry per (row, chunk); size for the largest grid of any batch size.
        if chunk is not None:
            plane = max_batch * cdiv(vocab, chunk)
        else:
            plane = max(b * cdiv(vocab, pick_chunk(b, vocab)) for b in range(1, max_batch + 1))
        ws.plane = plane
        f32, i32, i64 = torch.float32, torch.int32, torch.int64
        ws.stats_f = torch.zeros(8, plane, dtype=f32, device=device)
        ws.device = ws.stats_f.device  # resolved, "cuda" -> "cuda:0", to compare with inputs
        ws.stats_i = torch.zeros(6, plane, dtype=i32, device=device)
        ws.cand = torch.zeros(plane * cap, dtype=i64, device=device)
        ws.rcand = torch.zeros(plane * cap, dtype=i64, device=device)
        ws.rand_seeds = torch.zeros(max_batch, dtype=i64, device=device)
        ws.token_ids = torch.zeros(max_batch, dtype=i64, device=device)
        ws.logprob = torch.zeros(max_batch, dtype=f32, device=device)
        nlp = max(1, max_logprobs)
        ws.topn_ids = torch.zeros(max_batch * nlp, dtype=i64, device=device)
        ws.topn_logprobs = torch.zeros(max_batch * nlp, dtype=f32, device=device)
        ws.nan_rows = torch.zeros(max_batch, dtype=i32, device=device)
        ws.kept_threshold = torch.zeros(max_batch, dtype=f32, device=device)
        ws.kept_count = torch.zeros(max_batch, dtype=i32, device=device)
        ws.fallback_rows = torch.zeros(max_batch, dtype=i32, device=device)
        ws.scratch = torch.zeros(max_batch * 2 * _topn_width(nlp), dtype=i64, device=device)
        return ws


def _validate(logits: torch.Tensor, prm: SamplingParamsTensors, num_logprobs, logprobs_mode):
    check_tensor(
        "logits",
        logits,
        ndim=2,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        last_dim_contiguous=True,
    )
    check_kernel_device("logits", logits)
    B, V = logits.shape
    dev = logits.device
    if B < 1 or V < 1:
        raise ValueError(f"logits: expected a non-empty [B, V] tensor, got {list(logits.shape)}")
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(
            f"num_logprobs: expected None or a value in [0, {MAX_LOGPROBS}], got {num_logprobs}"
        )
    if num_logprobs is not None and num_logprobs > V:
        raise ValueError(
            f"num_logprobs: expected at most the vocabulary size {V}, got {num_logprobs}"
        )
    fl, ints = (torch.float32,), (torch.int32, torch.int64)
    per_row = {
        "temperature": fl,
        "top_p": fl,
        "min_p": fl,
        "repetition_penalty": fl,
        "frequency_penalty": fl,
        "presence_penalty": fl,
        "top_k": ints,
        "state_slots": ints,
        "seeds": (torch.int64,),
        "has_seed": (torch.bool,),
        "seed_offsets": (torch.int64,),
    }
    for name, dts in per_row.items():
        t = getattr(prm, name)
        if t is not None:
            check_tensor(f"params.{name}", t, shape=(B,), dtypes=dts, device=dev, contiguous=True)
    if prm.has_seed is not None and prm.seeds is None:
        raise ValueError("params.has_seed: given without params.seeds")
    words = cdiv(V, GROUP)
    if prm.has_penalties:
        for name in ("prompt_bin_mask", "output_bin_counts"):
            if getattr(prm, name) is None:
                raise ValueError(f"params.{name}: required when a penalty is given, got None")
        check_tensor(
            "params.prompt_bin_mask",
            prm.prompt_bin_mask,
            ndim=2,
            dtypes=(torch.int32,),
            device=dev,
            last_dim_contiguous=True,
        )
        S = prm.prompt_bin_mask.shape[0]
        check_tensor("params.prompt_bin_mask", prm.prompt_bin_mask, shape=(S, words))
        check_tensor(
            "params.output_bin_counts",
            prm.output_bin_counts,
            shape=(S, V),
            dtypes=(torch.int32,),
            device=dev,
            last_dim_contiguous=True,
        )
        if prm.output_bin_mask is not None:
            check_tensor(
                "params.output_bin_mask",
                prm.output_bin_mask,
                shape=(S, words),
                dtypes=(torch.int32,),
                device=dev,
                last_dim_contiguous=True,
            )
    if prm.has_bias:
        check_tensor(
            "params.logit_bias_counts",
            prm.logit_bias_counts,
            ndim=1,
            dtypes=(torch.int32,),
            device=dev,
            contiguous=True,
        )
        S = prm.logit_bias_counts.shape[0]
        for name, dts in (
            ("logit_bias_token_ids", (torch.int32,)),
            ("logit_bias_values", (torch.float32,)),
        ):
            t = getattr(prm, name)
            if t is None:
                raise ValueError(f"params.{name}: required with params.logit_bias_counts, got None")
            check_tensor(
                f"params.{name}",
                t,
                shape=(S, None),
                dtypes=dts,
                device=dev,
                last_dim_contiguous=True,
            )
        if prm.logit_bias_values.shape != prm.logit_bias_token_ids.shape:
            raise ValueError(
                f"params.logit_bias_values: expected shape {list(prm.logit_bias_token_ids.shape)}, "
                f"got {list(prm.logit_bias_values.shape)}"
            )
    elif prm.logit_bias_token_ids is not None or prm.logit_bias_values is not None:
        raise ValueError(
            "params.logit_bias_counts: required with logit_bias_token_ids/values, got None"
        )


def _fused_sample_into_impl(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    state_slots: torch.Tensor | None,
    prompt_bin_mask: torch.Tensor | None,
    output_bin_counts: torch.Tensor | None,
    output_bin_mask: torch.Tensor | None,
    logit_bias_counts: torch.Tensor | None,
    logit_bias_token_ids: torch.Tensor | None,
    logit_bias_values: torch.Tensor | None,
    seeds: torch.Tensor | None,
    has_seed: torch.Tensor | None,
    seed_offsets: torch.Tensor | None,
    stats_f: torch.Tensor,
    stats_i: torch.Tensor,
    cand: torch.Tensor,
    rcand: torch.Tensor,
    rand_seeds: torch.Tensor,
    token_ids: torch.Tensor,
    logprob: torch.Tensor,
    topn_ids: torch.Tensor,
    topn_logprobs: torch.Tensor,
    nan_rows: torch.Tensor,
    kept_threshold: torch.Tensor,
    kept_count: torch.Tensor,
    fallback_rows: torch.Tensor,
    scratch: torch.Tensor,
    num_logprobs: int,
    mode: int,
    chunk: int,
    cap: int,
    chunk_warps: int,
    maxnreg: int,
    pen_in_place: bool,
    exact_arith: bool,
) -> None:
    """Launch both kernels into the workspace tensors (see fused_sample). num_logprobs < 0:
    no top-n. mode: 0 none, 1..4 = LOGPROBS_MODES. pen_in_place: the chunk kernel writes the
    penalized values of seen tokens into `logits` first; both kernels then read them as
    plain logits. exact_arith: the workspace's `arith` is "torch"."""
    B, V = logits.shape
    has_pen = (
        repetition_penalty is not None
        or frequency_penalty is not None
        or presence_penalty is not None
    )
    pen_in_place = pen_in_place and has_pen
    has_bias = logit_bias_counts is not None
    if seeds is None:
        seed_mode = 0
    elif has_seed is None:
        seed_mode = 1
    else:
        seed_mode = 2
    if seed_mode != 1:
        # Device-drawn seeds from torch's global generator: no host sync, graph-capturable.
        rand_seeds[:B].random_()
    nc = cdiv(V, chunk)
    topn = num_logprobs > 0
    need_raw = mode in (1, 2)
    raw_cands = need_raw and topn and ((has_pen and not pen_in_place) or has_bias)
    dummy = logits
    args = (
        logits,
        logits.stride(0),
        V,
        nc,
        stats_f.shape[1],
        temperature if temperature is not None else dummy,
        top_k if top_k is not None else dummy,
        top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy,
        repetition_penalty if repetition_penalty is not None else dummy,
        frequency_penalty if frequency_penalty is not None else dummy,
        presence_penalty if presence_penalty is not None else dummy,
        state_slots if state_slots is not None else dummy,
        prompt_bin_mask if has_pen else dummy,
        prompt_bin_mask.stride(0) if has_pen else 0,
        output_bin_counts if has_pen else dummy,
        output_bin_counts.stride(0) if has_pen else 0,
        output_bin_mask if (has_pen and output_bin_mask is not None) else dummy,
        output_bin_mask.stride(0) if (has_pen and output_bin_mask is not None) else 0,
        logit_bias_counts if has_bias else dummy,
        logit_bias_token_ids if has_bias else dummy,
        logit_bias_values if has_bias else dummy,
        logit_bias_token_ids.stride(0) if has_bias else 0,
        seeds if seeds is not None else dummy,
        has_seed if has_seed is not None else dummy,
        rand_seeds,
        seed_offsets if seed_offsets is not None else dummy,
        stats_f,
        stats_i,
        cand,
        rcand,
    )
    flags = dict(
        HAS_TEMP=temperature is not None,
        EXACT=exact_arith,
        HAS_TOPK=top_k is not None,
        HAS_TOPP=top_p is not None,
        HAS_MINP=min_p is not None,
        HAS_REP=repetition_penalty is not None,
        HAS_FREQ=frequency_penalty is not None,
        HAS_PRES=presence_penalty is not None,
        HAS_SLOTS=state_slots is not None,
        HAS_PEN=has_pen and not pen_in_place,
        HAS_OUT_MASK=has_pen and output_bin_mask is not None,
        HAS_BIAS=has_bias,
        SEED_MODE=seed_mode,
        HAS_OFFSETS=seed_offsets is not None,
        RAW_CANDS=raw_cands,
        BIAS_BLOCK=BIAS_BLOCK,
    )
    extra = {"maxnreg": maxnreg} if maxnreg > 0 else {}
    launch(
        _sample_chunk_kernel,
        (nc, B),
        *args,
        CHUNK=chunk,
        CAP=cap,
        SUB=max(MIN_CHUNK, chunk // 4),
        NEED_RAW=need_raw,
        PEN_IN_PLACE=pen_in_place,
        BIT_STEPS=sampling_penalties.BIT_STEPS if pen_in_place else 1,
        num_warps=chunk_warps or chunk_warps_for(chunk),
        **extra,
        **flags,
    )
    nc_pad = _next_pow2(nc)
    tp = _topn_width(num_logprobs)  # the workspace's scratch holds its widest list a row
    launch(
        _sample_combine_kernel,
        (B,),
        *args,
        token_ids,
        logprob,
        topn_ids,
        topn_logprobs,
        nan_rows,
        kept_threshold,
        kept_count,
        fallback_rows,
        scratch,
        max(0, num_logprobs),
        NC_PAD=nc_pad,
        CAP=cap,
        MODE=mode,
        TP=tp,
        TOPN=topn,
        NP=FB_PIVOTS,
        FB_TILE=FB_TILE,
        KC=SURVIVORS,
        num_warps=4 if nc_pad * cap <= 2048 else 8,
        # two 8-warp programs per SM (a B=256 batch in one wave; ~30 bytes of spills)
        **({} if nc_pad * cap <= 2048 else {"maxnreg": COMBINE_MAXNREG}),
        **flags,
    )


_WORKSPACE_ARGS = (
    "stats_f",
    "stats_i",
    "cand",
    "rcand",
    "rand_seeds",
    "token_ids",
    "logprob",
    "topn_ids",
    "topn_logprobs",
    "nan_rows",
    "kept_threshold",
    "kept_count",
    "fallback_rows",
    "scratch",
)
_fused_sample_into = torch.library.custom_op(
    "fuselane::fused_sample_into", mutates_args=_WORKSPACE_ARGS
)(_fused_sample_into_impl)
# the same launch, declared as writing the logits (the penalties written in place)
_fused_sample_into_pen_ = torch.library.custom_op(
    "fuselane::fused_sample_into_pen_", mutates_args=("logits", *_WORKSPACE_ARGS)
)(_fused_sample_into_impl)


@_fused_sample_into.register_fake
def _(*args, **kwargs) -> None:
    return None


@_fused_sample_into_pen_.register_fake
def _(*args, **kwargs) -> None:
    return None


def fused_sample(
    logits: torch.Tensor,
    params: SamplingParamsTensors,
    *,
    workspace: SamplingWorkspace | None = None,
    num_logprobs: int | None = 0,
    logprobs_mode: str = "raw_logprobs",
    logits_writable: bool = False,
) -> SampleOutput:
    """Process `logits [B, V]` (fp32/bf16/fp16, stride 1 in V) and sample one token per row.

    num_logprobs: None = no log-probabilities; 0 = the chosen token's; n > 0 = also the top n
    (n <= 128). Two launches (plus one `random_` when some row has no seed), no host sync, no
    allocation when `workspace` is given: the outputs are views into it.

    logits_writable: the caller does not read `logits` afterwards (vLLM's V1 sampler penalizes
    its own fp32 logits in place too). With penalties on, fp32 logits, no logit bias and no raw
    log-probabilities asked for, the penalized values of the seen tokens are then written into
    `logits` (each chunk program rewrites its chunk's seen tokens, `sampling_penalties`, then
    reads it as plain logits): the same results, less work per value. Otherwise `logits` is
    never written.
    """
    _validate(logits, params, num_logprobs, logprobs_mode)
    B, V = logits.shape
    n = -1 if num_logprobs is None else num_logprobs
    ws = workspace
    if ws is None:
        ws = SamplingWorkspace.allocate(B, V, logits.device, max_logprobs=max(0, n))
    if ws.device != logits.device:
        raise ValueError(f"workspace: expected device {logits.device}, got {ws.device}")
    if B > ws.max_batch or V > ws.vocab:
        raise ValueError(
            f"workspace: sized for batch {ws.max_batch} and vocab {ws.vocab}, "
            f"got logits {list(logits.shape)}"
        )
    if n > ws.max_logprobs:
        raise ValueError(f"num_logprobs: workspace allows up to {ws.max_logprobs}, got {n}")
    mode = 0 if num_logprobs is None else _MODE_CODE[logprobs_mode]
    p = params
    in_place = (
        p.has_penalties
        and logits_writable
        and logits.dtype == torch.float32
        and not p.has_bias  # vLLM biases before it penalizes
        and mode not in (1, 2)  # raw values are read from the logits
    )
    chunk, warps, maxnreg = pick_launch(B, V, penalties=p.has_penalties and not in_place)
    if ws.chunk:  # an override (tests, the benchmark's sweep): its own warps / register cap
        chunk, warps, maxnreg = ws.chunk, ws.chunk_warps, ws.maxnreg
    if use_custom_op(logits):
        into = _fused_sample_into_pen_ if in_place else _fused_sample_into
    else:
        into = _fused_sample_into_impl
    into(
        logits,
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
        p.state_slots,
        p.prompt_bin_mask,
        p.output_bin_counts,
        p.output_bin_mask,
        p.logit_bias_counts,
        p.logit_bias_token_ids,
        p.logit_bias_values,
        p.seeds,
        p.has_seed,
        p.seed_offsets,
        ws.stats_f,
        ws.stats_i,
        ws.cand,
        ws.rcand,
        ws.rand_seeds,
        ws.token_ids,
        ws.logprob,
        ws.topn_ids,
        ws.topn_logprobs,
        ws.nan_rows,
        ws.kept_threshold,
        ws.kept_count,
        ws.fallback_rows,
        ws.scratch,
        n,
        mode,
        chunk,
        ws.cap,
        warps,
        maxnreg,
        in_place,
        ws.arith == "torch",
    )
    return SampleOutput(
        token_ids=ws.token_ids[:B],
        logprob=None if num_logprobs is None else ws.logprob[:B],
        topn_ids=ws.topn_ids[: B * n].view(B, n) if n > 0 else None,
        topn_logprobs=ws.topn_logprobs[: B * n].view(B, n) if n > 0 else None,
        nan_rows=ws.nan_rows[:B],
        kept_count=ws.kept_count[:B],
        kept_threshold=ws.kept_threshold[:B],
        fallback_rows=ws.fallback_rows[:B],
    )


# ---------------------------------------------------------------------------------------------
# Torch references (define the semantics; also the building blocks of the torch-sort peer)
# ---------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for int64 a in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + ((a * hi) & 0xFFFF) * 65536) & _M32


def _rotl32_t(a: torch.Tensor, s: int) -> torch.Tensor:
    return ((a << s) | (a >> (32 - s))) & _M32


def _mix_t(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl32_t(_mul32(k, 0xCC9E2D51), 15)
    k = _mul32(k, 0x1B873593)
    h = _rotl32_t(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix_t(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_noise_reference(
    seeds: torch.Tensor, offsets: torch.Tensor | None, tokens: torch.Tensor | int
) -> torch.Tensor:
    """Gumbel noise g[b, t] as a pure function of (seeds[b], offsets[b], token t).

    seeds, offsets: [B] int64; tokens: [T] int64 ids or an int V (ids 0..V-1). Returns [B, T]
    fp32. u = (murmur3_32(seed lo, seed hi, offset, t) + 0.5) * 2^-32 and g = -log(-log(1 - u))
    with vLLM V2's series for log(1 - u) when u < 0.25 (vllm/v1/worker/gpu/sample/gumbel.py).
    """
    dev = seeds.device
    if isinstance(tokens, int):
        tokens = torch.arange(tokens, device=dev, dtype=torch.int64)
    seeds = seeds.to(torch.int64)
    offsets = torch.zeros_like(seeds) if offsets is None else offsets.to(torch.int64)
    h = torch.zeros_like(seeds)
    h = _mix_t(h, seeds & _M32)
    h = _mix_t(h, (seeds >> 32) & _M32)
    h = _mix_t(h, offsets & _M32)
    r = _fmix_t(_mix_t(h[:, None], (tokens.to(torch.int64) & _M32)[None, :]) ^ 16)
    hi16 = (r >> 16).to(torch.float32)
    lo16 = (r & 0xFFFF).to(torch.float32)
    u = hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = c + u * poly
    series = -u * poly
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return -torch.log(-torch.where(u < 0.25, series, direct))


def unpack_bin_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, ceil(V/32)] int32 packed bits -> [S, V] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1  # int32 arithmetic shift, then the low bit
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def pack_bin_mask(mask: torch.Tensor) -> torch.Tensor:
    """[S, V] bool -> [S, ceil(V/32)] int32 packed bits (vLLM V2's prompt_bin_mask layout)."""
    S, V = mask.shape
    words = cdiv(V, GROUP)
    padded = torch.zeros(S, words * GROUP, dtype=torch.int64, device=mask.device)
    padded[:, :V] = mask.to(torch.int64)
    w = (padded.view(S, words, GROUP) << torch.arange(GROUP, device=mask.device)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def launch_batches(max_batch: int, vocab: int) -> list[int]:
    """The smallest batch of each launch configuration `pick_launch` gives batches 1..max_batch
    (at most three: the configuration changes only at two thresholds)."""
    firsts: dict[tuple[int, int, int], int] = {}
    for b in range(1, max_batch + 1):
        firsts.setdefault(pick_launch(b, vocab), b)
    return sorted(firsts.values())


# Per-row parameter sets whose kernel variants a serving start-up compiles: each a tuple of the
# SamplingParamsTensors fields given (the others None).
_WARM_VALUES = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}


def warm_up(
    template: SamplingParamsTensors,
    workspace: SamplingWorkspace,
    dtype: torch.dtype,
    *,
    param_sets: tuple[tuple[str, ...], ...],
    num_logprobs: int | None,
    logprobs_mode: str = "raw_logprobs",
) -> int:
    """Compile (by launching on zero logits) the kernel variants of every parameter set in
    `param_sets` at every launch configuration of batches up to `workspace.max_batch`, with the
    seed and slot arguments shaped as in `template` (a real call's parameters: the caller's
    vLLM sampler) and no penalties, bias or min-p. Returns the number of calls.

    For a serving engine's start-up (a variant first met while serving stalls that step for the
    compile): which parameters a batch carries decides which variant runs, and the batch size
    decides its launch configuration."""
    device, vocab = workspace.device, workspace.vocab
    calls = 0
    for b in launch_batches(workspace.max_batch, vocab):
        logits = torch.zeros(b, vocab, dtype=dtype, device=device)
        rows = dict(device=device)
        base = SamplingParamsTensors(
            state_slots=None
            if template.state_slots is None
            else torch.zeros(b, dtype=template.state_slots.dtype, **rows),
            seeds=None if template.seeds is None else torch.zeros(b, dtype=torch.int64, **rows),
            has_seed=None if template.has_seed is None else torch.ones(b, dtype=torch.bool, **rows),
            seed_offsets=None
            if template.seed_offsets is None
            else torch.zeros(b, dtype=torch.int64, **rows),
        )
        for fields in param_sets:
            p = dataclasses.replace(base)
            for name in fields:
                dt = torch.int32 if name == "top_k" else torch.float32
                setattr(p, name, torch.full((b,), _WARM_VALUES[name], dtype=dt, **rows))
            fused_sample(
                logits, p, workspace=workspace, num_logprobs=num_logprobs,
                logprobs_mode=logprobs_mode,
            )  # fmt: skip
            calls += 1
    return calls


def penalty_state_from_v1(
    prompt_token_ids: torch.Tensor,
    output_token_ids: list[list[int]] | torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM V1's penalty inputs -> (prompt_bin_mask, output_bin_counts, output_bin_mask).

    prompt_token_ids: [B, Lp] int64 padded with `vocab` (V1 SamplingMetadata); output_token_ids:
    V1's per-row lists, or a [B, Lo] tensor padded with `vocab` or -1. Rows map to slots 1:1
    (leave `state_slots` None). Runs on prompt_token_ids' device; list input costs one copy.
    """
    dev = prompt_token_ids.device
    B = prompt_token_ids.shape[0]
    if not isinstance(output_token_ids, torch.Tensor):
        width = max((len(o) for o in output_token_ids), default=0)
        out = torch.full((B, max(1, width)), vocab, dtype=torch.int64)
        for i, o in enumerate(output_token_ids):
            if o:
                out[i, : len(o)] = torch.tensor(o, dtype=torch.int64)
        output_token_ids = out.to(dev)
    out = output_token_ids.to(torch.int64).masked_fill(output_token_ids < 0, vocab)
    counts = torch.zeros(B, vocab + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    counts = counts[:, :vocab].contiguous()
    prompt = torch.zeros(B, vocab + 1, dtype=torch.bool, device=dev)
    prompt.scatter_(1, prompt_token_ids.to(torch.int64), True)
    return pack_bin_mask(prompt[:, :vocab]), counts, pack_bin_mask(counts > 0)


def logit_bias_from_dicts(
    biases: dict[int, dict[int, float]], num_rows: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM V1's LogitBiasLogitsProcessor state {row: {token: bias}} -> (counts [B] int32,
    token_ids [B, NB] int32, values [B, NB] fp32), rows mapping to slots 1:1."""
    width = max((len(d) for d in biases.values()), default=0)
    width = max(1, width)
    counts = torch.zeros(num_rows, dtype=torch.int32)
    toks = torch.zeros(num_rows, width, dtype=torch.int32)
    vals = torch.zeros(num_rows, width, dtype=torch.float32)
    for r, d in biases.items():
        counts[r] = len(d)
        toks[r, : len(d)] = torch.tensor(list(d.keys()), dtype=torch.int32)
        vals[r, : len(d)] = torch.tensor(list(d.values()), dtype=torch.float32)
    return counts.to(device), toks.to(device), vals.to(device)


def _clean_raw(logits: torch.Tensor) -> torch.Tensor:
    x = logits.to(torch.float32)
    x = torch.where(torch.isnan(x), float("-inf"), x)
    return torch.where(x == 0, 0.0, x)


def _slots(params: SamplingParamsTensors, B: int, device) -> torch.Tensor:
    if params.state_slots is None:
        return torch.arange(B, device=device)
    return params.state_slots.to(torch.int64)


def apply_bias_reference(y: torch.Tensor, params: SamplingParamsTensors) -> torch.Tensor:
    """y [B, V] fp32 + sparse logit bias of each row's slot (duplicates add up, list order)."""
    if not params.has_bias:
        return y
    B, V = y.shape
    slot = _slots(params, B, y.device)
    cnt = params.logit_bias_counts.to(torch.int64)[slot]
    toks = params.logit_bias_token_ids.to(torch.int64)[slot]
    vals = params.logit_bias_values[slot]
    live = torch.arange(toks.shape[1], device=y.device)[None, :] < cnt[:, None]
    flat = (torch.arange(B, device=y.device)[:, None] * V + toks)[live]
    out = y.clone().view(-1)
    out.index_add_(0, flat, vals[live])
    return out.view(B, V)


def apply_penalties_reference(y: torch.Tensor, params: SamplingParamsTensors) -> torch.Tensor:
    """vLLM's repetition, frequency, presence penalties (that order) on y [B, V] fp32."""
    if not params.has_penalties:
        return y
    B, V = y.shape
    dev = y.device
    one = torch.ones(B, device=dev)
    rep = params.repetition_penalty if params.repetition_penalty is not None else one
    freq = params.frequency_penalty if params.frequency_penalty is not None else 0 * one
    pres = params.presence_penalty if params.presence_penalty is not None else 0 * one
    slot = _slots(params, B, dev)
    cnt = params.output_bin_counts[slot].to(torch.float32)
    if params.output_bin_mask is not None:
        obit = unpack_bin_mask(params.output_bin_mask[slot], V)
        cnt = torch.where(obit, cnt, 0.0)
    else:
        obit = cnt > 0
    pbit = unpack_bin_mask(params.prompt_bin_mask[slot], V)
    scale = torch.where(pbit | obit, rep[:, None], 1.0)
    out = y * torch.where(y > 0, 1.0 / scale, scale)
    out = out - freq[:, None] * cnt
    out = out - pres[:, None] * obit.to(torch.float32)
    use = ((rep != 1) | (freq != 0) | (pres != 0))[:, None]
    return torch.where(use, out, y)


def apply_temperature_reference(
    y: torch.Tensor, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """z = y / T on random rows; greedy rows (T < 1e-5) keep y. Returns (z, greedy [B] bool)."""
    B = y.shape[0]
    if temperature is None:
        return y, torch.zeros(B, dtype=torch.bool, device=y.device)
    greedy = temperature < SAMPLING_EPS
    z = y / torch.where(greedy, 1.0, temperature)[:, None]
    return torch.where(z == 0, 0.0, z), greedy


def apply_min_p_reference(z: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Remove z < max(z) + log(min_p) on rows with min_p > 0 (vLLM V2's min_p kernel)."""
    if min_p is None:
        return z
    thr = z.max(dim=-1).values + torch.log(min_p)
    drop = (min_p > 0)[:, None] & (z < thr[:, None])
    return torch.where(drop, float("-inf"), z)


def top_k_top_p_reference(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sort-based top-k then top-p on z [B, V] fp32 (-inf = already removed), threshold ties.

    top-k keeps z >= the k-th largest value; top-p keeps z >= the largest value v whose mass
    S(v) = sum over z >= v of exp(z) (fp64, renormalised over the top-k survivors) reaches
    p * S(-inf). Returns z with -inf where removed.
    """
    if top_k is None and top_p is None:
        return z
    B, V = z.shape
    zs = torch.sort(z, dim=-1, descending=True).values
    thr = torch.full((B,), float("-inf"), device=z.device)
    if top_k is not None:
        k = top_k.to(torch.int64)
        on = (k > 0) & (k < V)
        kth = zs.gather(1, (k.clamp(1, V) - 1)[:, None]).squeeze(1)
        thr = torch.where(on, kth, thr)
        zs = torch.where(zs >= thr[:, None], zs, float("-inf"))
    if top_p is not None:
        on = top_p < 1.0
        e = torch.exp((zs - zs[:, :1]).double()).nan_to_num(0.0)  # all -inf rows: 0
        cum = e.cumsum(-1)
        # S(zs[i]) includes every tie of zs[i]: index of its last tie in descending order
        last = V - 1 - torch.searchsorted(zs.flip(-1).contiguous(), zs, right=False)
        s_geq = cum.gather(1, last.clamp(0, V - 1))
        ok = (s_geq >= top_p.double()[:, None] * cum[:, -1:]) & (zs > float("-inf"))
        first = ok.to(torch.int8).argmax(-1)
        taup = torch.where(ok.any(-1), zs.gather(1, first[:, None]).squeeze(1), float("-inf"))
        thr = torch.where(on, torch.maximum(thr, taup), thr)
    return torch.where(z >= thr[:, None], z, float("-inf"))


def _processed_unmasked(logits: torch.Tensor, params: SamplingParamsTensors):
    y = apply_penalties_reference(apply_bias_reference(_clean_raw(logits), params), params)
    return apply_temperature_reference(y, params.temperature)


def process_logits_reference(logits: torch.Tensor, params: SamplingParamsTensors) -> torch.Tensor:
    """logits [B, V] -> processed logits [B, V] fp32 (vLLM's order), -inf where removed.

    NaN -> -inf; bias; penalties; temperature (greedy rows unscaled); min-p; top-k; top-p.
    """
    z, _ = _processed_unmasked(logits, params)
    z = apply_min_p_reference(z, params.min_p)
    return top_k_top_p_reference(z, params.top_k, params.top_p)


def _row_seeds(params: SamplingParamsTensors, B: int, device) -> torch.Tensor:
    drawn = torch.randint(0, 2**62, (B,), device=device, dtype=torch.int64)
    if params.seeds is None:
        return drawn
    if params.has_seed is None:
        return params.seeds
    return torch.where(params.has_seed, params.seeds, drawn)


def sample_reference(
    logits: torch.Tensor,
    params: SamplingParamsTensors,
    *,
    num_logprobs: int | None = 0,
    logprobs_mode: str = "raw_logprobs",
) -> SampleOutput:
    """The semantics of `fused_sample` in plain torch (rows without a seed draw theirs from
    torch's global generator, so only seeded rows are comparable draw for draw)."""
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    B, V = logits.shape
    dev = logits.device
    x = _clean_raw(logits)
    pre, greedy = _processed_unmasked(logits, params)
    z = top_k_top_p_reference(apply_min_p_reference(pre, params.min_p), params.top_k, params.top_p)
    kept = z > float("-inf")
    g = gumbel_noise_reference(_row_seeds(params, B, dev), params.seed_offsets, V)
    scores = torch.where(kept, z + g, float("-inf"))
    tok = torch.where(greedy, z.argmax(-1), scores.argmax(-1))
    out = SampleOutput(
        token_ids=tok,
        logprob=None,
        topn_ids=None,
        topn_logprobs=None,
        nan_rows=torch.isnan(logits).sum(-1).to(torch.int32),
        kept_count=kept.sum(-1).to(torch.int32),
        kept_threshold=torch.where(kept, z, float("inf")).min(-1).values,
    )
    if num_logprobs is None:
        return out
    if logprobs_mode.startswith("raw"):
        vals = x.log_softmax(-1) if logprobs_mode == "raw_logprobs" else x
        order_key = x
    else:
        vals = z.double().log_softmax(-1).float() if logprobs_mode == "processed_logprobs" else z
        order_key = pre
    vals = torch.where(vals.isnan(), float("-inf"), vals)  # no finite value: -inf, not NaN
    out.logprob = vals.gather(1, tok[:, None]).squeeze(1)
    if num_logprobs > 0:
        # n best by the mode's ordering (raw x, or z before the masks), ties by lowest id
        order = torch.sort(order_key, dim=-1, descending=True, stable=True).indices[
            :, :num_logprobs
        ]
        ok = order_key.gather(1, order) > float("-inf")
        out.topn_ids = torch.where(ok, order, -1)
        out.topn_logprobs = torch.where(ok, vals.gather(1, order), float("-inf"))
    return out


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of `counts` [K] against `probs` [K]
    (categories with zero probability must have zero counts, else p = 0)."""
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    n = counts.sum()
    live = probs > 0
    if (counts[~live] > 0).any():
        return 0.0
    exp = probs[live] / probs[live].sum() * n
    stat = ((counts[live] - exp) ** 2 / exp).sum()
    dof = int(live.sum()) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))

"""Repetition / frequency / presence penalties written into the logits, for seen tokens only.

The fused sampler applies penalties to every value it loads: at B=256 x V=151936 that is about
25 instructions per value for the ~1.5% of tokens a request has seen (2000 prompt + 256 output
ids), and the chunk kernel is bound by instruction issue, not DRAM. When the caller lets the
logits be overwritten (vLLM's V1 sampler penalizes its fp32 logits in place as well), this
pre-pass walks the set bits of the packed words (one word per lane, lowest bit first),
gathers and rewrites only the seen tokens, and the sampler then runs its plain variant. Per
token the arithmetic and its order are those of `sampling_select._process`, so both paths give
bit-identical values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch

GROUP = 32  # tokens per word of the packed prompt/output bit masks
# Four packed words per lane at 4 warps: each bit step issues four independent gathers, and
# B=256 x V=151936 runs in ~2600 programs (128 words: ~9500 programs of one dependent
# gather chain each, 40 us).
WORDS_PER_PROGRAM = 512
WARPS = 4


@triton.jit
def _penalize_seen_kernel(
    logits_ptr,
    stride_row,
    V,
    NW,
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
    WORDS: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
):
    """Grid (cdiv(NW, WORDS), B): program (c, b) rewrites the seen tokens of words
    [c*WORDS, (c+1)*WORDS) of row b in place (fp32 logits), one word per lane. NaN stays NaN
    (the sampler counts it); unseen tokens are neither read nor written."""
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    rep = tl.full((), 1.0, tl.float32)
    if HAS_REP:
        rep = tl.load(rep_ptr + row)
    freq = tl.full((), 0.0, tl.float32)
    if HAS_FREQ:
        freq = tl.load(freq_ptr + row)
    pres = tl.full((), 0.0, tl.float32)
    if HAS_PRES:
        pres = tl.load(pres_ptr + row)
    if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
        slot = row
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + row).to(tl.int64)
        w = c * WORDS + tl.arange(0, WORDS)
        wok = w < NW
        if HAS_OUT_MASK:
            ow = tl.load(omask_ptr + slot * omask_stride + w, mask=wok, other=0)
        else:
            # the output bits from a coalesced read of the dense counts (distinct bits: sum = or)
            j = tl.arange(0, 32)[None, :]
            tok2 = w[:, None] * 32 + j
            c2 = tl.load(counts_ptr + slot * counts_stride + tok2, mask=tok2 < V, other=0)
            ow = tl.sum(tl.where(c2 > 0, 1 << j, 0), axis=1)
        # A token only in the prompt changes only under a repetition penalty.
        todo = ow
        if rep != 1.0:
            todo = todo | tl.load(pmask_ptr + slot * pmask_stride + w, mask=wok, other=0)
        inv_rep = 1.0 / rep
        xrow = logits_ptr + row * stride_row
        crow = counts_ptr + slot * counts_stride
        # One set bit per lane per step, lowest first: as many steps as the most bits a word
        # of this program holds (about 1.5% of a row's tokens are seen), not 32.
        left = tl.sum((todo != 0).to(tl.int32), axis=0)
        while left > 0:
            low = todo & (-todo)
            todo = todo ^ low
            # bit index = exponent of the (exact) fp32 value of the power of two
            lowf = low.to(tl.uint32, bitcast=True).to(tl.float32)
            pos = (lowf.to(tl.int32, bitcast=True) >> 23) - 127
            tok = w * 32 + pos
            hit = (low != 0) & (tok < V)
            obit = hit & (((ow >> pos) & 1) != 0)
            y = tl.load(xrow + tok, mask=hit, other=0.0)
            if rep != 1.0:
                y = y * tl.where(y > 0, inv_rep, rep)
            if freq != 0.0:
                cnt = tl.load(crow + tok, mask=obit, other=0)
                y = y - freq * cnt.to(tl.float32)
            if pres != 0.0:
                y = y - pres * obit.to(tl.float32)
            tl.store(xrow + tok, y, mask=hit)
            left = tl.sum((todo != 0).to(tl.int32), axis=0)


def penalize_seen_(
    logits: torch.Tensor,
    repetition_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    state_slots: torch.Tensor | None,
    prompt_bin_mask: torch.Tensor,
    output_bin_counts: torch.Tensor,
    output_bin_mask: torch.Tensor | None,
) -> None:
    """Apply the penalties to `logits [B, V]` (fp32, stride 1 in V) in place. Inputs as in
    `sampling.SamplingParamsTensors` (validated by `fused_sample`, the only caller)."""
    B, V = logits.shape
    nw = cdiv(V, GROUP)
    dummy = logits
    has_omask = output_bin_mask is not None
    launch(
        _penalize_seen_kernel,
        (cdiv(nw, WORDS_PER_PROGRAM), B),
        logits,
        logits.stride(0),
        V,
        nw,
        repetition_penalty if repetition_penalty is not None else dummy,
        frequency_penalty if frequency_penalty is not None else dummy,
        presence_penalty if presence_penalty is not None else dummy,
        state_slots if state_slots is not None else dummy,
        prompt_bin_mask,
        prompt_bin_mask.stride(0),
        output_bin_counts,
        output_bin_counts.stride(0),
        output_bin_mask if has_omask else dummy,
        output_bin_mask.stride(0) if has_omask else 0,
        WORDS=WORDS_PER_PROGRAM,
        HAS_REP=repetition_penalty is not None,
        HAS_FREQ=frequency_penalty is not None,
        HAS_PRES=presence_penalty is not None,
        HAS_SLOTS=state_slots is not None,
        HAS_OUT_MASK=has_omask,
        num_warps=WARPS,
    )


penalize_seen_op = torch.library.custom_op("fuselane::penalize_seen_", mutates_args=("logits",))(
    penalize_seen_
)


@penalize_seen_op.register_fake
def _(*args, **kwargs) -> None:
    return None

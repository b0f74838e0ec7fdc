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
  (`penalties.penalize_words`), then reads the chunk as plain logits.
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
Parameters outside the domain vLLM's SamplingParams accepts (temperature NaN, infinite or < 0;
top_p NaN or <= 0; min_p NaN or outside [0, 1]; repetition penalty NaN, infinite or <= 0;
frequency / presence penalty not finite) cannot come from vLLM; a direct caller's row with
one gets token -1 and nan_rows -1 (its other outputs are unspecified), never a token drawn
from NaN scores. top_p >= 1 and k <= 0 or >= V mean "off". Logit-bias lists are contiguous
[S, width]; a count outside [0, width] uses the whole list or none of it, never more.
+inf logits are not supported (vLLM turns them into NaN as well).

vLLM 0.32 vs 0.33 (what the plugin adapts): V2 `SamplingStates.get_top_k_top_p` returns
(top_k, top_p) in 0.32 and adds `has_topp_only_rows` in 0.33; V2's Gumbel gained
`spec_step_seed` (seed ^ (draft column << 32)) for draft logits caches in 0.33; V2 penalties'
block size became the module constant PENALTIES_BLOCK_SIZE; V1's Triton top-k got a fast path
for rows with <= k finite logits. The sampling formulas used here are the same in both.
V1 differs from V2 in ways the plugin must route: V1 draws exponential noise from torch
generators (draws cannot match bit for bit), keeps exactly k in its Triton top-k, and an
all-greedy V1 batch returns processed logprobs without the top-k/top-p masks.

One launch (`row._sample_row_kernel`, grid (B,)) for small batches (`plan.use_one_launch`:
B <= 8 and V <= 32768, and top-p without top-k up to 16 rows at any V, from the H200 sweep):
one program per row does the chunk kernel's work over its row (up to 32768 values at a time,
held in registers, with a longer candidate list, `plan.row_launch`) and then the combine
kernel's, with the same device
functions (`chunk.chunk_partials`, `combine.combine_row`): the same kept sets and the same Gumbel
draws, so the same tokens for the same seeds, in one launch and one program per row.

Modules: `chunk` and `combine` (the two Triton kernels), `row` (the one-launch kernel); `keys`,
`tiles`, `search` and `penalties` (their building blocks); `params` (the argument bundles),
`plan` (constants, launch rules), `workspace`, `checks`, `ops` (the entry points), `reference`.
"""

from __future__ import annotations

from . import (
    checks,
    chunk,
    combine,
    keys,
    ops,
    params,
    penalties,
    plan,
    reference,
    row,
    search,
    tiles,
    workspace,
)
from .keys import SAMPLING_EPS
from .ops import (
    fused_sample,
    warm_up,
)
from .params import (
    SampleOutput,
    SamplingParamsTensors,
)
from .penalties import GROUP
from .plan import (
    BIAS_BLOCK,
    CAP,
    CHUNK_LARGE,
    CHUNK_SMALL,
    COMBINE_MAXNREG,
    FB_PIVOTS,
    FB_TILE,
    LARGE_GRID_MAXNREG_PEN,
    LARGE_GRID_WARPS,
    LOGPROBS_MODES,
    MAX_LOGPROBS,
    MIN_CHUNK,
    ONE_WAVE_PROGRAMS,
    SMALL_CHUNK_PROGRAMS,
    SURVIVORS,
    TOPN_WIDTHS,
    chunk_warps_for,
    launch_batches,
    launch_plan,
    pick_chunk,
    pick_launch,
    row_launch,
    use_one_launch,
)
from .reference import (
    apply_bias_reference,
    apply_min_p_reference,
    apply_penalties_reference,
    apply_temperature_reference,
    gumbel_noise_reference,
    pack_bin_mask,
    process_logits_reference,
    sample_reference,
    top_k_top_p_reference,
    unpack_bin_mask,
)
from .workspace import (
    ARITH_MODES,
    SamplingWorkspace,
)

__all__ = [
    "ARITH_MODES",
    "BIAS_BLOCK",
    "CAP",
    "CHUNK_LARGE",
    "CHUNK_SMALL",
    "COMBINE_MAXNREG",
    "FB_PIVOTS",
    "FB_TILE",
    "GROUP",
    "LARGE_GRID_MAXNREG_PEN",
    "LARGE_GRID_WARPS",
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "MIN_CHUNK",
    "ONE_WAVE_PROGRAMS",
    "SAMPLING_EPS",
    "SMALL_CHUNK_PROGRAMS",
    "SURVIVORS",
    "TOPN_WIDTHS",
    "SampleOutput",
    "SamplingParamsTensors",
    "SamplingWorkspace",
    "apply_bias_reference",
    "apply_min_p_reference",
    "apply_penalties_reference",
    "apply_temperature_reference",
    "checks",
    "chunk",
    "chunk_warps_for",
    "combine",
    "fused_sample",
    "gumbel_noise_reference",
    "keys",
    "launch_batches",
    "launch_plan",
    "ops",
    "pack_bin_mask",
    "params",
    "penalties",
    "pick_chunk",
    "pick_launch",
    "plan",
    "process_logits_reference",
    "reference",
    "row",
    "row_launch",
    "sample_reference",
    "search",
    "tiles",
    "top_k_top_p_reference",
    "unpack_bin_mask",
    "use_one_launch",
    "warm_up",
    "workspace",
]

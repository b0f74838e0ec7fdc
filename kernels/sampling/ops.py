"""The fused sampler's entry points: the launch of both kernels, its custom ops (with fakes for
torch.compile), `fused_sample`, and the start-up warm-up."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from .. import index_checks
from .._launch import cdiv, launch, use_custom_op
from . import penalties as sampling_penalties
from .checks import _validate
from .chunk import _sample_chunk_kernel
from .combine import _sample_combine_kernel
from .params import SampleOutput, SamplingParamsTensors
from .plan import (
    _MODE_CODE,
    BIAS_BLOCK,
    COMBINE_MAXNREG,
    FB_PIVOTS,
    FB_TILE,
    MIN_CHUNK,
    ROW_FB_TILE,
    SURVIVORS,
    _next_pow2,
    _topn_width,
    chunk_warps_for,
    launch_batches,
    pick_launch,
    row_launch,
    use_one_launch,
)
from .row import _sample_row_kernel
from .workspace import SamplingWorkspace


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
    one_launch: bool,
) -> None:
    """Launch both kernels into the workspace tensors (see fused_sample), or with one_launch
    the one-row-per-program kernel that does both kernels' work (`chunk`, `cap`, `chunk_warps`
    its configuration, `plan.row_launch`). num_logprobs < 0: no top-n. mode: 0 none, 1..4 =
    LOGPROBS_MODES. pen_in_place: the chunk kernel writes the penalized values of seen tokens
    into `logits` first; both kernels then read them as plain logits. exact_arith: the
    workspace's `arith` is "torch"."""
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
    chunk_flags = dict(
        CHUNK=chunk,
        CAP=cap,
        SUB=max(MIN_CHUNK, chunk // 4),
        NEED_RAW=need_raw,
        PEN_IN_PLACE=pen_in_place,
        BIT_STEPS=sampling_penalties.BIT_STEPS if pen_in_place else 1,
    )
    nc_pad = _next_pow2(nc)
    tp = _topn_width(num_logprobs)  # the workspace's scratch holds its widest list a row
    outs = (
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
    )
    combine_flags = dict(
        NC_PAD=nc_pad, CAP=cap, MODE=mode, TP=tp, TOPN=topn, NP=FB_PIVOTS, KC=SURVIVORS, **flags
    )
    if one_launch:
        launch(
            _sample_row_kernel,
            (B,),
            *args,
            *outs,
            **{**chunk_flags, **combine_flags},  # the same CAP in both
            FB_TILE=max(FB_TILE, min(chunk, ROW_FB_TILE)),
            num_warps=chunk_warps,
        )
        return
    extra = {"maxnreg": maxnreg} if maxnreg > 0 else {}
    launch(
        _sample_chunk_kernel,
        (nc, B),
        *args,
        **chunk_flags,
        num_warps=chunk_warps or chunk_warps_for(chunk),
        **extra,
        **flags,
    )
    launch(
        _sample_combine_kernel,
        (B,),
        *args,
        *outs,
        **combine_flags,
        FB_TILE=FB_TILE,
        num_warps=4 if nc_pad * cap <= 2048 else 8,
        # two 8-warp programs per SM (a B=256 batch in one wave; ~30 bytes of spills)
        **({} if nc_pad * cap <= 2048 else {"maxnreg": COMBINE_MAXNREG}),
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


# The op's arguments after the logits: the parameter bundle's fields, then the workspace's
# tensors, in their declared orders (checked against the op's signature below).
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParamsTensors))
_op_names = tuple(inspect.signature(_fused_sample_into_impl).parameters)
if _op_names[1 : 1 + len(_PARAM_FIELDS) + len(_WORKSPACE_ARGS)] != _PARAM_FIELDS + _WORKSPACE_ARGS:
    raise ImportError("fused_sample_into's arguments are out of step with its bundles")


def _fields(bundle: object, names: tuple[str, ...]) -> tuple:
    return tuple(getattr(bundle, name) for name in names)


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
    (n <= 128). Two launches, or one for small batches (`plan.use_one_launch`; the workspace
    can force either), plus one `random_` when some row has no seed; no host sync, no
    allocation when `workspace` is given: the outputs are views into it. Both paths draw the
    same tokens for the same seeds (the Gumbel noise is a function of seed, offset and token).

    logits_writable: the caller does not read `logits` afterwards (vLLM's V1 sampler penalizes
    its own fp32 logits in place too). With penalties on, fp32 logits, no logit bias and no raw
    log-probabilities asked for, the penalized values of the seen tokens are then written into
    `logits` (each chunk program rewrites its chunk's seen tokens, `penalties`, then
    reads it as plain logits): the same results, less work per value. Otherwise `logits` is
    never written.
    """
    _validate(logits, params, num_logprobs, logprobs_mode)
    B, V = logits.shape
    if index_checks.enabled():  # FUSELANE_CHECK_INDICES: the device-side indices, synced
        _check_indices(params, V)
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
    one = ws.one_launch
    if one is None:  # the rule; a chunk override (tests, the sweep) means two launches
        top_p_only = p.top_p is not None and p.top_k is None
        one = not ws.chunk and use_one_launch(B, V, top_p_only)
    if one:
        chunk, cap, warps = row_launch(V, ws.chunk or 0, ws.row_cap)
        warps, maxnreg = ws.chunk_warps or warps, 0
    else:
        chunk, warps, maxnreg = pick_launch(B, V, penalties=p.has_penalties and not in_place)
        cap = ws.cap
        if ws.chunk:  # an override (tests, the benchmark's sweep): its own warps / register cap
            chunk, warps, maxnreg = ws.chunk, ws.chunk_warps, ws.maxnreg
    entries = B * cdiv(V, chunk)
    if entries > ws.plane or entries * cap > ws.cand.numel():  # never written out of bounds
        path = "one launch" if one else "two launches"
        raise ValueError(
            f"workspace: {path} of {B} rows x {V} logits needs {entries} (row, chunk) entries "
            f"of {cap} candidates; it holds {ws.plane} and {ws.cand.numel()} candidates "
            "(allocate it with the rule, or with one_launch for the path you force)"
        )
    if use_custom_op(logits):
        into = _fused_sample_into_pen_ if in_place else _fused_sample_into
    else:
        into = _fused_sample_into_impl
    into(
        logits, *_fields(p, _PARAM_FIELDS), *_fields(ws, _WORKSPACE_ARGS), n, mode, chunk, cap,
        warps, maxnreg, in_place, ws.arith == "torch", one,
    )  # fmt: skip
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


def _check_indices(p: SamplingParamsTensors, vocab: int) -> None:
    """State slots within the per-slot tensors; the bias entries in use name real tokens."""
    if p.state_slots is not None:
        if p.has_penalties:
            index_checks.check_state_slots(
                p.state_slots, p.prompt_bin_mask.shape[0], "rows of params.prompt_bin_mask"
            )
        if p.has_bias:
            index_checks.check_state_slots(
                p.state_slots, p.logit_bias_counts.shape[0], "rows of params.logit_bias_counts"
            )
    if p.has_bias:
        width = p.logit_bias_token_ids.shape[1]
        live = (
            torch.arange(width, device=p.logit_bias_counts.device)[None, :]
            < (p.logit_bias_counts.long()[:, None])
        )
        index_checks.check_token_ids("params.logit_bias_token_ids", p.logit_bias_token_ids,
                                     live, vocab)  # fmt: skip


_WARM_VALUES = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}
# Warm-up parameter-set entries beyond the per-row fields above: "penalties" sets the three
# penalties with their prompt state and output counts (a penalized batch runs other kernel
# variants, and in place when `logits_writable`; both samplers pass the counts without presence
# bits), "seeded" gives every row its own seed (seeds and has_seed: vLLM V1's form of seeded
# requests; a batch's seed form is a constexpr of both kernels).
WARM_EXTRA_FIELDS = ("penalties", "seeded")
_WARM_PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1}


def _warm_params(
    template: SamplingParamsTensors, b: int, device: torch.device
) -> SamplingParamsTensors:
    """Parameters of a `b`-row warm-up call: the seed and slot arguments shaped as in
    `template`, nothing else set."""

    def like(t: torch.Tensor | None, fill: float, dtype: torch.dtype | None = None):
        return None if t is None else torch.full((b,), fill, dtype=dtype or t.dtype, device=device)

    return SamplingParamsTensors(
        state_slots=like(template.state_slots, 0),
        seeds=like(template.seeds, 0, torch.int64),
        has_seed=like(template.has_seed, True, torch.bool),
        seed_offsets=like(template.seed_offsets, 0, torch.int64),
    )


def _set_warm_penalties(p: SamplingParamsTensors, b: int, vocab: int, device: torch.device) -> None:
    """Penalties on every row of `p`, with empty prompt and output state: one slot when rows
    map to slots through `state_slots` (the warm-up's slots are all 0), else one per row."""
    for name, value in _WARM_PENALTIES.items():
        setattr(p, name, torch.full((b,), value, dtype=torch.float32, device=device))
    slots = 1 if p.state_slots is not None else b
    p.prompt_bin_mask = torch.zeros(slots, cdiv(vocab, 32), dtype=torch.int32, device=device)
    p.output_bin_counts = torch.zeros(slots, vocab, dtype=torch.int32, device=device)


def warm_up(
    template: SamplingParamsTensors,
    workspace: SamplingWorkspace,
    dtype: torch.dtype,
    *,
    param_sets: tuple[tuple[str, ...], ...],
    num_logprobs: int | None,
    logprobs_mode: str = "raw_logprobs",
    logits_writable: bool = False,
) -> int:
    """Compile (by launching on zero logits) the kernel variants of every parameter set in
    `param_sets` at every launch configuration of batches up to `workspace.max_batch`, with the
    seed and slot arguments shaped as in `template` (a real call's parameters: the caller's
    vLLM sampler) and `logits_writable` as the caller's real calls pass it. A set names per-row
    fields (temperature, top_k, top_p) and optionally WARM_EXTRA_FIELDS; bias and min-p are
    never set. Returns the number of calls.

    For a serving engine's start-up (a variant first met while serving stalls that step for the
    compile): which parameters a batch carries decides which variant runs, and the batch size
    decides its launch configuration."""
    device, vocab = workspace.device, workspace.vocab
    for fields in param_sets:
        unknown = set(fields) - set(_WARM_VALUES) - set(WARM_EXTRA_FIELDS)
        if unknown:
            raise ValueError(
                f"param_sets: {fields} names {sorted(unknown)} "
                f"(entries: {sorted(_WARM_VALUES)} and {list(WARM_EXTRA_FIELDS)})"
            )
    # Top-p without top-k has its own one-launch batches (`plan.use_one_launch`).
    batches = {
        fields: launch_batches(
            workspace.max_batch, vocab, "top_p" in fields and "top_k" not in fields
        )
        for fields in param_sets
    }
    calls = 0
    for b in sorted(set().union(*batches.values())):
        logits = torch.zeros(b, vocab, dtype=dtype, device=device)
        base = _warm_params(template, b, device)
        for fields in param_sets:
            if b not in batches[fields]:
                continue
            p = dataclasses.replace(base)
            for name in fields:
                if name in WARM_EXTRA_FIELDS:
                    continue
                dt = torch.int32 if name == "top_k" else torch.float32
                setattr(p, name, torch.full((b,), _WARM_VALUES[name], dtype=dt, device=device))
            if "penalties" in fields:
                _set_warm_penalties(p, b, vocab, device)
            if "seeded" in fields:
                p.seeds = torch.zeros(b, dtype=torch.int64, device=device)
                p.has_seed = torch.ones(b, dtype=torch.bool, device=device)
            fused_sample(
                logits, p, workspace=workspace, num_logprobs=num_logprobs,
                logprobs_mode=logprobs_mode, logits_writable=logits_writable,
            )  # fmt: skip
            calls += 1
    return calls

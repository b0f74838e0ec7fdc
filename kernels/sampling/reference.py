"""Torch references that define the fused sampler's semantics: the murmur3 Gumbel noise, the
packed masks, penalties, bias, temperature, min-p, top-k / top-p and the draw."""

from __future__ import annotations

import torch

from .._checks import check_choice
from .._launch import cdiv
from .keys import SAMPLING_EPS
from .params import SampleOutput, SamplingParamsTensors
from .penalties import GROUP
from .plan import LOGPROBS_MODES

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
    padded = torch.zeros(S, words * GROUP, dtype=torch.bool, device=mask.device)
    padded[:, :V] = mask
    shifts = torch.arange(GROUP, dtype=torch.int32, device=mask.device)
    # In int32 throughout: the 32 bits of a word are distinct powers of two, bit 31 being
    # -2^31, so their sum never overflows and is the word's two's-complement value (an int64
    # form took ~3x the memory traffic: 1.0 against 0.29 s at 256 x 151,936 on the development
    # CPU, JSON not kept).
    return (padded.view(S, words, GROUP).to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


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
    width = params.logit_bias_token_ids.shape[1]
    cnt = params.logit_bias_counts.to(torch.int64)[slot].clamp(0, width)  # the list, no more
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


def params_out_of_domain_reference(
    params: SamplingParamsTensors, B: int, device: torch.device
) -> torch.Tensor:
    """[B] bool: rows whose parameters lie outside the domain vLLM's SamplingParams accepts
    (temperature finite and >= 0, top_p > 0, min_p in [0, 1], repetition penalty finite and
    > 0, frequency / presence penalties finite). `fused_sample` answers them with token -1
    and nan_rows -1; top_p >= 1 is "off", not out of domain."""
    bad = torch.zeros(B, dtype=torch.bool, device=device)

    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(torch.float32)

    t, p, mp = f32(params.temperature), f32(params.top_p), f32(params.min_p)
    r, fq, pr = (f32(params.repetition_penalty), f32(params.frequency_penalty),
                 f32(params.presence_penalty))  # fmt: skip
    if t is not None:
        bad |= t.isnan() | (t < 0) | (t == float("inf"))
    if p is not None:
        bad |= p.isnan() | (p <= 0)
    if mp is not None:
        bad |= mp.isnan() | (mp < 0) | (mp > 1)
    if r is not None:
        bad |= r.isnan() | (r <= 0) | (r == float("inf"))
    for x in (fq, pr):
        if x is not None:
            bad |= ~x.isfinite()
    return bad


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
    bad = params_out_of_domain_reference(params, B, dev)
    out = SampleOutput(
        token_ids=torch.where(bad, -1, tok),
        logprob=None,
        topn_ids=None,
        topn_logprobs=None,
        nan_rows=torch.where(bad, -1, torch.isnan(logits).sum(-1).to(torch.int32)),
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

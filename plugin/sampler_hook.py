"""The sampler hook: vLLM's sampling step runs fuselane's fused sampling kernel.

Seam: `install()` (called by `register()` when
FUSELANE_KERNELS has `sampling`) rebinds the module-global name `Sampler` of vLLM's two model
runner modules to a fuselane subclass of vLLM's own class, only while the name is still vLLM's
class: V1 (`vllm.v1.worker.gpu_model_runner`, the CPU runner inherits it) gets
`FuselaneSampler`, V2 (`vllm.v1.worker.gpu.model_runner`, the GPU default in 0.32/0.33; vLLM's
CPU V2 runner subclasses it) gets `FuselaneV2Sampler`. The modules are usually not imported yet
when plugins load, so the rebinding runs from a post-import hook (a `sys.meta_path` finder that
wraps those modules' loaders). Each runner, its rejection sampler and its dummy/profile sampler
runs get the subclass; vLLM's other samplers (watermark, MTP) are untouched. The undo restores
the names (if they are still ours) and removes the finder.

V1, per batch (`SamplingMetadata`): `FuselaneSampler.forward` runs `fused_sample` when
everything the batch asks for is supported, else vLLM's own `forward` for the whole batch:

- fused: greedy / random / mixed rows (temperature), top-k, top-p, min-p (vLLM's builtin
  min-p processor's tensor), repetition / frequency / presence penalties (`penalty_state_from_v1`
  from prompt_token_ids + output_token_ids), logit bias (the builtin processor's dict, via
  `logit_bias_from_dicts`), logprobs n in [0, 128] in `raw_logprobs` / `raw_logits`.
- stock (reason counted): spec decode (`predict_bonus_token`, spec_token_ids), allowed token
  ids, bad words, active min_tokens, any non-builtin logits processor, logprob_token_ids,
  max_num_logprobs == -1 or > 128, processed-logprob modes, fp64 gumbel, logits dtype other than
  fp32/bf16/fp16 and thinking budget. Rows with NaN logits stay fused, with no host sync: the
  kernel never samples a NaN (stock V1 would sample from NaN probabilities).

V1 seeded rows: V1 keeps a torch.Generator per seeded request and draws `probs / Exp(1)` from
it; fuselane's kernel draws murmur3 Gumbel noise from an int64 seed. Each step, a seeded row's
seed is a fresh 62-bit integer drawn from the request's own generator (one `randint` on the
generator's device). So the same request seed gives the same tokens run to run, preemption and
batch composition do not matter (the generator's state is per request, as in stock), but the
draws are not stock's bit for bit: the distribution is the same, the tokens are not. Unseeded
rows take the kernel's global-generator seeds.

V2 (vLLM >= 0.32; `vllm_compat.v2_sampler_api_gap` says why an older V2 sampler, 0.26's, keeps
vLLM's path with a warning, counted `stock:v2_version`): `FuselaneV2Sampler` overrides
`add_request` (records per request slot what V2 turns on that the kernel cannot take) and
`__call__` (decides per batch from host data only, then one `fused_sample` call). Its inputs are
V2's own per-slot state, read in place: `SamplingStates` (temperature, top_k, top_p, min_p,
seeds), `PenaltiesState` (prompt_bin_mask, output_bin_counts, kept by V2's bincount and
post_update; the rows reach them through `state_slots` = expanded_idx_mapping) and
`LogitBiasState`'s padded per-slot bias lists; the per-row scalars are gathered (one small
launch each), nothing [S, V]-sized is copied. V2 gives every slot a seed (a random one for
unseeded requests) and draws Gumbel noise as murmur3(seed, position, token); the kernel takes
the same seeds with `seed_offsets` = positions and the same formulas in the same order (bias,
penalties, temperature as `y / T`, min-p, top-k, top-p), so its tokens are stock V2's bit for
bit, seeded or not, except where stock V2 itself draws otherwise: FlashInfer's sampler (V2 uses
it for batches with top-k/top-p and no greedy row, no explicit seed, no processed logprobs when
FlashInfer is installed) and V2's Triton top-k, which keeps exactly k where the k-th value is
tied (the kernel keeps the whole tie, as V2's torch path does).

- fused: greedy / random / mixed rows, top-k, top-p, min-p, repetition / frequency / presence
  penalties, logit bias, min_tokens once every row is past it, logprobs n in [0, 128] in
  `raw_logprobs` / `raw_logits` (token ids, values, V2's rank over the raw logits), num_nans
  (VLLM_COMPUTE_NANS_IN_LOGITS) from the kernel's NaN count, the dummy/profile batches.
- stock (reason counted): per slot allowed token ids, bad words, thinking budget, trace replay;
  per batch active min_tokens (stop tokens still masked: V2 masks them while
  `pos + 1 < prompt_len + min_tokens`, checked on the host's sequence-length bound), draft rows
  (`spec_decode`: rows != requests, num_draft_tokens > 0), logprob_token_ids, num_logprobs == -1
  or > 128, processed-logprob modes (V2's rank would need its processed-logits tensor), logits
  dtype / vocabulary mismatch; per sampler fp64 gumbel, `return_sampling_mask`, any custom
  logits processor.
- NaN logits: no host sync on the V2 path (V2 prepares the next step while this one runs; a
  sync would stall it). The kernel never samples a NaN (stock V2 may pick one) and the batch
  stays fused.

Counters: `counters()` (per process) has `fused`, `stock`, and `stock:<reason>`; the telemetry
seams (`plugin/telemetry.py`) count and time both paths as `impl="fuselane"` / `impl="stock"`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import sampling_state, telemetry, vllm_compat, warmup
from .config import KernelSelection

__all__ = ["counters", "install", "make_v1_sampler", "make_v2_sampler", "reset_counters"]

_SAMPLING = telemetry.seam(telemetry.SAMPLING)
_SAMPLING_STOCK = telemetry.seam(telemetry.SAMPLING, impl=telemetry.STOCK)

_COUNTS: Counter = Counter()
_LOCK = threading.Lock()
_FUSED_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")
_SEED_BOUND = 1 << 62


def counters() -> dict[str, int]:
    """This process's batch counts: `fused`, `stock` and `stock:<reason>`."""
    with _LOCK:
        return dict(_COUNTS)


def reset_counters() -> None:
    with _LOCK:
        _COUNTS.clear()


def _count(key: str, reason: str | None = None) -> None:
    with _LOCK:
        _COUNTS[key] += 1
        if reason:
            _COUNTS[f"{key}:{reason}"] += 1


# ---------------------------------------------------------------------------------------------
# V1: per-batch decision and parameter mapping
# ---------------------------------------------------------------------------------------------


def _unsupported_v1(
    sampler: Any, logits: torch.Tensor, md: Any, predict_bonus_token: bool, mode: str
) -> str | None:
    """Why this batch must take vLLM's path, or None when fuselane's kernel can take it all."""
    from fuselane.kernels import sampling

    if predict_bonus_token or any(md.spec_token_ids or ()):
        return "spec_decode"
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.ndim != 2:
        return "dtype"
    if getattr(sampler, "use_fp64_gumbel", False):
        return "fp64_gumbel"
    if md.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    if md.bad_words_token_ids:
        return "bad_words"
    if md.logprob_token_ids:
        return "logprob_token_ids"
    n = md.max_num_logprobs
    if n is not None:
        if n < 0 or n > sampling.MAX_LOGPROBS or n > logits.shape[1]:
            return "num_logprobs"
        if mode not in _FUSED_LOGPROBS_MODES:
            return "logprobs_mode"
    holder = getattr(md, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "thinking_budget"
    if not md.all_greedy and md.temperature is None:
        return "no_temperature"
    if not md.no_penalties and md.prompt_token_ids is None:
        return "penalties"
    min_p_cls = vllm_compat.MinPLogitsProcessor
    bias_cls = vllm_compat.LogitBiasLogitsProcessor
    min_tokens_cls = vllm_compat.MinTokensLogitsProcessor
    for proc in md.logitsprocs.all:
        if type(proc) is min_tokens_cls:
            if proc.min_toks:
                return "min_tokens"
        elif type(proc) is min_p_cls:
            if proc.min_p_count and proc.min_p.numel() != logits.shape[0]:
                return "min_p_shape"
        elif type(proc) is not bias_cls:
            return "logits_processor"
    return None


def _seeds_v1(generators: dict[int, torch.Generator], B: int, device: torch.device):
    """(seeds, has_seed) for the seeded rows: a fresh seed from each request's own generator."""
    rows = [r for r in generators if r < B]
    if not rows:
        return None, None
    vals = torch.cat(
        [
            torch.randint(
                0, _SEED_BOUND, (1,), generator=generators[r], device=generators[r].device
            )
            for r in rows
        ]
    ).to(device)
    idx = torch.tensor(rows, dtype=torch.int64).to(device)
    seeds = torch.zeros(B, dtype=torch.int64, device=device)
    has_seed = torch.zeros(B, dtype=torch.bool, device=device)
    seeds[idx] = vals
    has_seed[idx] = True
    return seeds, has_seed


def _f32(t: torch.Tensor | None, B: int) -> torch.Tensor | None:
    return None if t is None else t[:B].reshape(B).to(torch.float32).contiguous()


def _params_v1(sampler: Any, logits: torch.Tensor, md: Any):
    from fuselane.kernels import sampling

    B, V = logits.shape
    dev = logits.device
    p = sampling.SamplingParamsTensors()
    if md.all_greedy:
        # V1's all-greedy batches skip temperature, min-p and top-k/top-p entirely.
        p.temperature = torch.zeros(B, dtype=torch.float32, device=dev)
    else:
        p.temperature = _f32(md.temperature, B)
        if md.top_k is not None:
            p.top_k = md.top_k[:B].contiguous()
        p.top_p = _f32(md.top_p, B)
        for proc in md.logitsprocs.argmax_invariant:
            if type(proc) is vllm_compat.MinPLogitsProcessor and proc.min_p_count:
                p.min_p = _f32(proc.min_p, B)
        p.seeds, p.has_seed = _seeds_v1(md.generators, B, dev)
    if not md.no_penalties:
        p.prompt_bin_mask, p.output_bin_counts, p.output_bin_mask = (
            sampling_state.penalty_state_from_v1(
                md.prompt_token_ids[:B], md.output_token_ids[:B], V
            )
        )
        p.repetition_penalty = _f32(md.repetition_penalties, B)
        p.frequency_penalty = _f32(md.frequency_penalties, B)
        p.presence_penalty = _f32(md.presence_penalties, B)
    for proc in md.logitsprocs.non_argmax_invariant:
        if type(proc) is vllm_compat.LogitBiasLogitsProcessor and proc.biases:
            p.logit_bias_counts, p.logit_bias_token_ids, p.logit_bias_values = (
                sampler._bias_tensors(proc, B, dev)
            )
    return p


def _logprobs_tensors(
    out: Any, sampled: torch.Tensor, logits: torch.Tensor, n: int | None, ids_dtype: torch.dtype
) -> Any:
    """vLLM's LogprobsTensors from the kernel's outputs (None when no logprobs were asked):
    the chosen token, then its top n (-1 padding of rows with fewer finite values becomes 0),
    and vLLM's rank of the chosen token: how many raw logits are >= it (V1's log_softmax and
    V2's _ranks_kernel order tokens alike)."""
    if n is None:
        return None
    ids = [sampled.unsqueeze(-1)]
    lps = [out.logprob.unsqueeze(-1)]
    if n > 0:
        ids.append(out.topn_ids.clamp(min=0))
        lps.append(out.topn_logprobs)
    ranks = (logits >= logits.gather(-1, sampled.unsqueeze(-1))).sum(-1)
    return vllm_compat.LogprobsTensors(
        torch.cat(ids, dim=1).to(ids_dtype), torch.cat(lps, dim=1).to(torch.float32), ranks
    )


# Parameter sets whose kernel variants start-up compiles (kernels.sampling.warm_up): greedy and
# the usual temperature / top-k / top-p mixes. V1 always passes a temperature (zeros for an
# all-greedy batch); V2 passes none when every row has temperature 1.
V1_WARM_PARAM_SETS = (
    ("temperature",), ("temperature", "top_k", "top_p"), ("temperature", "top_p"),
    ("temperature", "top_k"),
)  # fmt: skip
V2_WARM_PARAM_SETS = (
    (), ("temperature",), ("temperature", "top_k", "top_p"), ("temperature", "top_p"),
)  # fmt: skip
# A batch asking for logprobs runs other kernel variants than one asking none: 0 (the chosen
# token's) is one, and top-n one per list width (kernels.sampling.TOPN_WIDTHS). Start-up also
# compiles 0 and the two narrowest widths (up to 8, up to 32) for greedy and the usual
# sampling mix; otherwise the first request with `logprobs` stalls its step for the compile
# (vLLM 0.26's JIT monitor named both sampling kernels on an H200, 2026-11-26). Above 32 (vLLM
# allows 20 by default) the first such request compiles the widest.
WARM_TOPN_WIDTHS = 2
WARM_LOGPROB_PARAM_SETS = (("temperature",), ("temperature", "top_k", "top_p"))
# The kernel's rounding (kernels.sampling.ARITH_MODES) for both runners: Triton's, which is
# what V2's own sampler kernels compute (so the fused tokens stay V2's bit for bit on a GPU).
# V1's torch sampler rounds each operation; matching it costs 8-40% of the kernel's time at
# B=32-256 (sampling-arith-torch-h200-2026-11-26.json against sampling-h200-2026-11-26.json),
# and V1's fused draws already differ from its stock ones, so V1 takes the fast rounding too.
V1_ARITH = V2_ARITH = "triton"


def _warm_up(
    runner: str, logits: torch.Tensor, params: Any, ws: Any, n: int | None, mode: str,
    param_sets: tuple[tuple[str, ...], ...],
) -> bool:  # fmt: skip
    """Compile the sampling kernels' common variants on the sampler's first call (vLLM's dummy
    sampler run at start-up); True once done (plugin/warmup.py)."""
    from fuselane.kernels import sampling

    key = ("sampling", runner, str(logits.device), logits.dtype, ws.vocab, ws.max_batch, n, mode)

    def compile_all() -> int:
        calls = sampling.warm_up(
            params, ws, logits.dtype, param_sets=param_sets, num_logprobs=n, logprobs_mode=mode
        )
        # the smallest logprob count of each list width: 1, then one past each narrower width
        firsts = (1, *(w + 1 for w in sampling.TOPN_WIDTHS[:-1]))
        for extra in (0, *firsts[:WARM_TOPN_WIDTHS]):
            if extra != n:
                calls += sampling.warm_up(
                    params, ws, logits.dtype, param_sets=WARM_LOGPROB_PARAM_SETS,
                    num_logprobs=extra, logprobs_mode=mode,
                )  # fmt: skip
        return calls

    try:
        return warmup.once("sampling", key, logits.device, compile_all)
    except Exception as e:  # noqa: BLE001 - any failure here must not stop the engine
        # A variant that cannot compile or launch here: vLLM's sampler takes every batch of
        # this process, rather than one failing while serving.
        disable_fused_sampling(f"{type(e).__name__} at start-up: {e}"[:500])
        return True


# Why fused sampling is off in this process (None: on).
_fused_off: str | None = None


def disable_fused_sampling(reason: str) -> None:
    """Send every later batch of this process to vLLM's sampler (counted `stock:startup`)."""
    global _fused_off
    _fused_off = reason
    vllm_compat.get_logger().warning(
        "fuselane: the sampling kernel failed its start-up warm-up (%s); vLLM's sampler runs "
        "every batch of this process",
        reason,
    )


def fused_sampling_off() -> str | None:
    """Why fused sampling is off in this process (None: on)."""
    return _fused_off


def make_v1_sampler(base: type) -> type:
    """A subclass of vLLM V1's `Sampler` class `base` whose forward runs fuselane's kernel."""

    class FuselaneSampler(base):
        """vLLM's V1 Sampler with its forward routed to fuselane's fused sampling kernel for
        every batch whose features the kernel covers (see fuselane.plugin.sampler_hook)."""

        fuselane_stock_class = base

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._fuselane_ws = None
            self._fuselane_warmed = False
            self._fuselane_bias_key: tuple | None = None
            self._fuselane_bias: tuple | None = None

        def _workspace(self, logits: torch.Tensor):
            from fuselane.kernels import sampling

            B, V = logits.shape
            ws = self._fuselane_ws
            if ws is None or ws.max_batch < B or ws.vocab != V or ws.device != logits.device:
                # Sized once in practice: the runner's dummy sampler run uses max_num_seqs rows.
                rows = max(B, ws.max_batch if ws is not None and ws.vocab == V else 0)
                ws = sampling.SamplingWorkspace.allocate(
                    rows, V, logits.device, max_logprobs=sampling.MAX_LOGPROBS, arith=V1_ARITH
                )
                self._fuselane_ws = ws
            return ws

        def _bias_tensors(self, proc: Any, B: int, dev: torch.device) -> tuple:
            # The builtin processor replaces bias_tensor whenever its dict changes.
            key = (proc.bias_tensor, B, dev)
            last = self._fuselane_bias_key
            if last is None or last[0] is not key[0] or last[1:] != key[1:]:
                self._fuselane_bias = sampling_state.logit_bias_from_dicts(proc.biases, B, dev)
                self._fuselane_bias_key = key
            return self._fuselane_bias

        def forward(
            self,
            logits: torch.Tensor,
            sampling_metadata: Any,
            predict_bonus_token: bool = False,
            logprobs_mode_override: Any = None,
        ) -> Any:
            md = sampling_metadata
            mode = logprobs_mode_override or self.logprobs_mode
            off = _fused_off is not None
            reason = (
                "startup" if off else _unsupported_v1(self, logits, md, predict_bonus_token, mode)
            )
            if reason is None:
                out = self._fused(logits, md, mode)
                if out is not None:
                    _count("fused")
                    return out
                reason = "startup"
            _count("stock", reason)
            return _SAMPLING_STOCK(
                None,
                super().forward,
                logits,
                md,
                predict_bonus_token=predict_bonus_token,
                logprobs_mode_override=logprobs_mode_override,
            )

        def _fused(self, logits: torch.Tensor, md: Any, mode: str) -> Any:
            from fuselane.kernels import sampling

            params = _params_v1(self, logits, md)
            n = md.max_num_logprobs
            ws = self._workspace(logits)
            if not self._fuselane_warmed:
                self._fuselane_warmed = _warm_up(
                    "v1", logits, params, ws, n, mode, V1_WARM_PARAM_SETS
                )
                if _fused_off is not None:
                    return None
            out = _SAMPLING(
                None,
                sampling.fused_sample,
                logits,
                params,
                workspace=ws,
                num_logprobs=n,
                logprobs_mode=mode,
                # V1 penalizes these fp32 logits in place itself; the ranks below read them
                logits_writable=n is None,
            )
            # No host sync for NaN rows (as on V2): the kernel never samples a NaN (stock V1
            # would sample garbage from NaN probabilities) and the runner can prepare the next
            # step while this one runs. V1 has no output field for the count.
            sampled = out.token_ids.to(torch.int64)  # a copy: the workspace is reused
            return vllm_compat.SamplerOutput(
                sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),
                logprobs_tensors=_logprobs_tensors(out, sampled, logits, n, torch.int32),
            )

    FuselaneSampler.__qualname__ = FuselaneSampler.__name__
    return FuselaneSampler


# ---------------------------------------------------------------------------------------------
# V2: per-slot and per-batch decisions, parameters straight from V2's per-slot states
# ---------------------------------------------------------------------------------------------


def _unsupported_v2_request(sampler: Any, sp: Any) -> str | None:
    """Why requests with SamplingParams `sp` must take vLLM's path (checked once, in add_request).

    Each condition is the one under which V2's own state turns the feature on for the slot
    (LogitBiasState, BadWordsState, ThinkingBudgetState, TraceReplayState.add_request).
    """
    if getattr(sp, "allowed_token_ids", None):
        return "allowed_token_ids"
    if getattr(sp, "bad_words_token_ids", None):
        return "bad_words"
    thinking = getattr(sampler, "thinking_budget_state", None)
    budget = getattr(sp, "thinking_token_budget", None)
    if getattr(thinking, "enabled", False) and budget is not None:
        return "thinking_budget"
    if (
        getattr(sampler, "trace_replay_state", None) is not None
        and getattr(sp, "trace_decode_token_ids", None) is not None
    ):
        return "trace_replay"
    return None


def _unsupported_v2_sampler(sampler: Any) -> str | None:
    """Why no batch of this V2 sampler can be fused (its construction options), or None."""
    if getattr(sampler, "use_fp64_gumbel", False):
        return "fp64_gumbel"
    if getattr(sampler, "return_sampling_mask", False):
        return "sampling_mask"  # needs V2's processed-logits tensor
    builtin = (
        vllm_compat.V2LogitBiasState,
        vllm_compat.V2PenaltiesState,
        vllm_compat.V2BadWordsState,
    )
    if any(type(p) not in builtin for p in getattr(sampler, "logits_processors", ())):
        return "logits_processor"
    if sampler._fuselane_bias_state is None:
        return "no_bias_state"
    return None


def _unsupported_v2(
    sampler: Any, logits: torch.Tensor, batch: Any
) -> tuple[str | None, int | None]:
    """(why this batch must take vLLM's path or None, num_logprobs or None). Host data only."""
    from fuselane.kernels import sampling

    if sampler._fuselane_reason is not None:
        return sampler._fuselane_reason, None
    # Draft rows: the rejection sampler normally takes them; an expanded batch that reaches
    # the plain sampler keeps vLLM's per-draft penalties and cu_num_logits handling.
    if batch.num_draft_tokens or logits.ndim != 2 or logits.shape[0] != batch.num_reqs:
        return "spec_decode", None
    if logits.shape[0] == 0:
        return "empty", None
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.stride(-1) != 1:
        return "dtype", None
    if logits.shape[1] != sampler.sampling_states.vocab_size:
        return "vocab", None
    idx_np = batch.idx_mapping_np
    codes = sampler._fuselane_slot_reason[idx_np]
    if codes.any():
        return _V2_SLOT_REASONS[int(codes[codes.nonzero()[0][0]])], None
    if _min_tokens_active(sampler, batch):
        return "min_tokens", None
    n = None
    dims = sampler.get_logprobs_dims(idx_np)
    if dims is not None:
        n, num_token_ids = dims
        if num_token_ids:
            return "logprob_token_ids", None
        if n > sampling.MAX_LOGPROBS or n > logits.shape[1]:
            return "num_logprobs", None
        if sampler.logprobs_mode not in _FUSED_LOGPROBS_MODES:
            # The rank of the chosen token would need V2's processed-logits tensor.
            return "logprobs_mode", None
    return None, n


_V2_SLOT_REASONS = (None, "allowed_token_ids", "bad_words", "thinking_budget", "trace_replay")


def _min_tokens_active(sampler: Any, batch: Any) -> bool:
    """Whether a row of the batch still has its stop tokens masked by min_tokens.

    V2 masks them (a bias of -inf) while `pos + 1 < prompt_len + min_tokens`, a per-step
    condition the kernel's static per-slot bias lists cannot express; once every row is past
    it, the batch is fused. pos + 1 is the row's sequence length; the host's bound on it is
    exact without speculation and may exceed it by the drafts a step rejected with it, so the
    check keeps that many tokens of slack.
    """
    bias = sampler._fuselane_bias_state
    idx_np = batch.idx_mapping_np
    masked = bias.num_stop_token_ids.np[idx_np] > 0
    if not masked.any():
        return False
    seq_len_bound = batch.seq_lens_cpu_upper_bound.numpy()[: len(idx_np)]
    slack = max(0, int(getattr(sampler, "num_speculative_tokens", 1)) - 1)
    return bool(np.any(masked & (seq_len_bound - slack < bias.min_lens.np[idx_np])))


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-slot state `t` ([max_num_reqs], a V2 UVA/device tensor) gathered for the batch rows."""
    return t.index_select(0, idx)


def _params_v2(sampler: Any, batch: Any) -> Any:
    """The kernel's parameters from V2's own per-slot states (no copies of the [S, V] state).

    Rows map to request slots through `expanded_idx_mapping`: per-row scalars are gathered
    (one small launch each), penalty and bias state is read in place through `state_slots`.
    Which features are on is decided from the states' host mirrors (`.np`), as V2 does.
    """
    from fuselane.kernels import sampling

    ss = sampler.sampling_states
    idx = batch.expanded_idx_mapping.contiguous()
    idx_np = batch.idx_mapping_np
    p = sampling.SamplingParamsTensors(state_slots=idx)
    if not np.all(ss.temperature.np[idx_np] == 1.0):
        p.temperature = _rows(ss.temperature.gpu, idx)
    # V2's "off" values: top_k = vocab_size, top_p = 1, min_p = 0 (the kernel's too).
    if np.any(ss.top_k.np[idx_np] != ss.vocab_size):
        p.top_k = _rows(ss.top_k.gpu, idx)
    if np.any(ss.top_p.np[idx_np] != 1.0):
        p.top_p = _rows(ss.top_p.gpu, idx)
    if np.any(ss.min_p.np[idx_np] != 0.0):
        p.min_p = _rows(ss.min_p.gpu, idx)
    pen = sampler.penalties_state
    if np.any(pen.use_penalty[idx_np]):
        p.repetition_penalty = _rows(pen.repetition_penalty.gpu, idx)
        p.frequency_penalty = _rows(pen.frequency_penalty.gpu, idx)
        p.presence_penalty = _rows(pen.presence_penalty.gpu, idx)
        # output_bin_counts is kept by V2's post_update; no presence bits, so a dense read.
        p.prompt_bin_mask = pen.prompt_bin_mask
        p.output_bin_counts = pen.output_bin_counts
    bias = sampler._fuselane_bias_state
    if np.any(bias.num_logit_bias.np[idx_np] > 0):
        p.logit_bias_counts = bias.num_logit_bias.gpu
        p.logit_bias_token_ids = bias.logit_bias_token_ids.gpu
        p.logit_bias_values = bias.logit_bias.gpu
    # V2 gives every slot a seed (a random one for unseeded requests) and draws its noise at
    # the token's position: the same (seed, position, token) -> the same Gumbel noise.
    p.seeds = _rows(ss.seeds.gpu, idx)
    p.seed_offsets = batch.positions[batch.logits_indices].to(torch.int64)
    return p


def make_v2_sampler(base: type) -> type:
    """A subclass of vLLM V2's `Sampler` class `base` whose `__call__` runs fuselane's kernel."""

    class FuselaneV2Sampler(base):
        """vLLM's V2 Sampler with `__call__` routed to fuselane's fused sampling kernel for every
        batch whose requests' features the kernel covers (see fuselane.plugin.sampler_hook)."""

        fuselane_stock_class = base

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from fuselane.kernels import sampling

            ss = self.sampling_states
            self._fuselane_slot_reason = np.zeros(ss.max_num_reqs, dtype=np.int8)
            self._fuselane_bias_state = next(
                (
                    p
                    for p in getattr(self, "logits_processors", ())
                    if type(p) is vllm_compat.V2LogitBiasState
                ),
                None,
            )
            self._fuselane_reason = _unsupported_v2_sampler(self)
            self._fuselane_warmed = False
            # Sized here, before vLLM's memory profiling, for the most rows __call__ gets.
            # arith="triton": V2's own sampler is Triton kernels (its `/` and fused
            # multiply-adds); the same rounding keeps the fused tokens V2's bit for bit.
            self._fuselane_ws = sampling.SamplingWorkspace.allocate(
                ss.max_num_reqs,
                ss.vocab_size,
                self.req_states.device,
                max_logprobs=sampling.MAX_LOGPROBS,
                arith=V2_ARITH,
            )

        def add_request(self, req_idx: int, sampling_params: Any) -> None:
            super().add_request(req_idx, sampling_params)
            reason = _unsupported_v2_request(self, sampling_params)
            self._fuselane_slot_reason[req_idx] = _V2_SLOT_REASONS.index(reason)

        def _workspace(self, logits: torch.Tensor):
            from fuselane.kernels import sampling

            B, V = logits.shape
            ws = self._fuselane_ws
            if ws.max_batch < B or ws.vocab != V or ws.device != logits.device:
                ws = sampling.SamplingWorkspace.allocate(
                    max(B, ws.max_batch), V, logits.device, max_logprobs=sampling.MAX_LOGPROBS,
                    arith=V2_ARITH,
                )  # fmt: skip
                self._fuselane_ws = ws
            return ws

        def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
            reason, num_logprobs = (
                ("startup", None)
                if _fused_off is not None
                else _unsupported_v2(self, logits, input_batch)
            )
            if reason is None:
                out = self._fused(logits, input_batch, num_logprobs)
                if out is not None:
                    _count("fused")
                    return out
                reason = "startup"
            _count("stock", reason)
            return _SAMPLING_STOCK(None, super().__call__, logits, input_batch)

        def _fused(self, logits: torch.Tensor, batch: Any, n: int | None) -> Any:
            from fuselane.kernels import sampling

            params = _params_v2(self, batch)
            ws = self._workspace(logits)
            if not self._fuselane_warmed:
                self._fuselane_warmed = _warm_up(
                    "v2", logits, params, ws, n, self.logprobs_mode, V2_WARM_PARAM_SETS
                )
                if _fused_off is not None:
                    return None
            out = _SAMPLING(
                None,
                sampling.fused_sample,
                logits,
                params,
                workspace=ws,
                num_logprobs=n,
                logprobs_mode=self.logprobs_mode,
                # the runner does not read the logits after sampling; the ranks below do
                logits_writable=n is None,
            )
            # Copies: the workspace is overwritten by the next step while the runner still
            # reads these (async output copy, post_update). No host sync: NaN rows are not
            # re-routed (V2 overlaps the next step's preparation with this one); the kernel
            # never samples a NaN, and num_nans reports them as V2 does.
            sampled = out.token_ids.clone()
            logprobs_tensors = _logprobs_tensors(out, sampled, logits, n, sampled.dtype)
            num_sampled, num_rejected = vllm_compat.v2_num_sampled_and_rejected(
                batch.seq_lens.new_ones(batch.num_reqs),
                batch.seq_lens,
                batch.cu_num_logits,
                batch.idx_mapping,
                self.req_states.prefill_len.gpu,
            )
            return vllm_compat.V2SamplerOutput(
                sampled_token_ids=sampled.view(-1, 1),
                logprobs_tensors=logprobs_tensors,
                num_nans=out.nan_rows.clone() if self.compute_nans else None,
                num_sampled=num_sampled,
                num_rejected=num_rejected,
            )

    FuselaneV2Sampler.__qualname__ = FuselaneV2Sampler.__name__
    return FuselaneV2Sampler


def make_v2_placeholder(base: type, gap: str) -> type:
    """vLLM V2's `Sampler` of a version whose API fuselane's V2 path does not fit (`gap`, see
    `vllm_compat.v2_sampler_api_gap`): it warns when the runner builds it and runs vLLM's
    sampler, counted and timed as `stock:v2_version`."""

    class FuselaneV2Sampler(base):
        fuselane_placeholder = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            vllm_compat.get_logger().warning(
                "fuselane: FUSELANE_KERNELS asks for sampling, but this vLLM's V2 sampler (%s) "
                "is not one fuselane's V2 path supports (%s): vLLM's own sampler runs "
                "(VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner, which gets fuselane's)",
                vllm_compat.vllm_version(),
                gap,
            )

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _count("stock", "v2_version")
            return _SAMPLING_STOCK(None, super().__call__, *args, **kwargs)

    FuselaneV2Sampler.__qualname__ = FuselaneV2Sampler.__name__
    return FuselaneV2Sampler


# ---------------------------------------------------------------------------------------------
# Installation: post-import rebinding of the runner modules' `Sampler`
# ---------------------------------------------------------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after one of `names` is executed by its own loader."""

    def __init__(self, names: tuple[str, ...], callback: Callable[[Any], None]) -> None:
        self.names = names
        self.callback = callback
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PostExecLoader(spec.loader, self.callback)
        return spec


class _PostExecLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


def install(selection: KernelSelection) -> Callable[[], None]:
    """Hook the runner modules (now if imported, else when they are); return the undo."""
    log = vllm_compat.get_logger()
    patched: dict[str, tuple[Any, type, type]] = {}  # module name -> (module, stock, ours)
    v1_name = vllm_compat.V1_RUNNER_MODULE
    v2_name = vllm_compat.V2_RUNNER_MODULE

    def on_import(module: Any) -> None:
        if module.__name__ == v2_name:
            stock = getattr(module, "Sampler", None)
            if not isinstance(stock, type) or stock.__module__ != vllm_compat.V2_SAMPLER_MODULE:
                log.warning(
                    "fuselane: %s.Sampler is %r, not vLLM's own; left as it is", v2_name, stock
                )
                return
            gap = vllm_compat.v2_sampler_api_gap(stock)
            ours = make_v2_sampler(stock) if gap is None else make_v2_placeholder(stock, gap)
        else:
            stock = vllm_compat.V1Sampler
            current = getattr(module, "Sampler", None)
            if current is not stock:
                log.warning(
                    "fuselane: %s.Sampler is %r, not vLLM's own Sampler; sampling left as it is",
                    module.__name__,
                    current,
                )
                return
            ours = make_v1_sampler(stock)
        module.Sampler = ours
        patched[module.__name__] = (module, stock, ours)
        log.info(
            "fuselane: %s.Sampler -> %s%s",
            module.__name__,
            ours.__name__,
            "" if getattr(ours, "fuselane_placeholder", False) else " (sampling kernel active)",
        )

    finder = _PostImportFinder((v1_name, v2_name), on_import)
    for name in finder.names:
        if name in sys.modules:
            on_import(sys.modules[name])
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for module, stock, ours in patched.values():
            if getattr(module, "Sampler", None) is ours:
                module.Sampler = stock
        patched.clear()

    return undo

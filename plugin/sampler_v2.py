"""vLLM's V2 model runner: per-slot and per-batch decisions, the kernel's parameters read from
V2's own per-slot states, and the `Sampler` subclass (see plugin/sampler_hook.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import sampler_common as common
from . import vllm_compat


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
        if sampler.logprobs_mode not in common.FUSED_LOGPROBS_MODES:
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
                arith=common.V2_ARITH,
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
                    arith=common.V2_ARITH,
                )  # fmt: skip
                self._fuselane_ws = ws
            return ws

        def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
            reason, num_logprobs = (
                ("startup", None)
                if common.fused_sampling_off() is not None
                else _unsupported_v2(self, logits, input_batch)
            )
            return common.route(
                reason,
                lambda: self._fused(logits, input_batch, num_logprobs),
                super().__call__,
                logits,
                input_batch,
            )

        def _fused(self, logits: torch.Tensor, batch: Any, n: int | None) -> Any:
            params = _params_v2(self, batch)
            out = common.run_fused(
                self, "v2", logits, params, n, self.logprobs_mode, common.V2_WARM_PARAM_SETS
            )
            if out is None:
                return None
            # Copies: the workspace is overwritten by the next step while the runner still
            # reads these (async output copy, post_update). No host sync: NaN rows are not
            # re-routed (V2 overlaps the next step's preparation with this one); the kernel
            # never samples a NaN, and num_nans reports them as V2 does.
            sampled = out.token_ids.clone()
            logprobs_tensors = common._logprobs_tensors(out, sampled, logits, n, sampled.dtype)
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
            common._count("stock", "v2_version")
            return common._SAMPLING_STOCK(None, super().__call__, *args, **kwargs)

    FuselaneV2Sampler.__qualname__ = FuselaneV2Sampler.__name__
    return FuselaneV2Sampler

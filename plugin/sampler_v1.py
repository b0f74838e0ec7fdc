"""vLLM's V1 model runner: the per-batch decision and parameter mapping, and the `Sampler`
subclass whose forward runs the fused kernel (see plugin/sampler_hook.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import sampler_common as common
from . import sampling_state, vllm_compat


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
        if mode not in common.FUSED_LOGPROBS_MODES:
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
                0, common.SEED_BOUND, (1,), generator=generators[r], device=generators[r].device
            )
            for r in rows
        ]
    ).to(device)
    idx = sampling_state.to_device(torch.tensor(rows, dtype=torch.int64), device)
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
            # V1 keeps int64; int32 is the variant start-up compiles (and V2 passes)
            p.top_k = md.top_k[:B].to(torch.int32).contiguous()
        p.top_p = _f32(md.top_p, B)
        for proc in md.logitsprocs.argmax_invariant:
            if type(proc) is vllm_compat.MinPLogitsProcessor and proc.min_p_count:
                p.min_p = _f32(proc.min_p, B)
        p.seeds, p.has_seed = _seeds_v1(md.generators, B, dev)
    if not md.no_penalties:
        p.prompt_bin_mask = sampler._prompt_mask(md.prompt_token_ids, B, V)
        # Counts only: the kernel reads them densely (the presence bits cost more to build
        # each step than they save it).
        p.output_bin_counts, _ = sampling_state.output_state_from_v1(
            md.output_token_ids[:B], V, dev, with_mask=False
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
            # name -> (key, value) of `_kept`
            self._fuselane_kept: dict[str, tuple[tuple, Any]] = {}

        def _workspace(self, logits: torch.Tensor):
            from fuselane.kernels import sampling

            B, V = logits.shape
            ws = self._fuselane_ws
            if ws is None or ws.max_batch < B or ws.vocab != V or ws.device != logits.device:
                # Sized once in practice: the runner's dummy sampler run uses max_num_seqs rows.
                rows = max(B, ws.max_batch if ws is not None and ws.vocab == V else 0)
                ws = sampling.SamplingWorkspace.allocate(
                    rows,
                    V,
                    logits.device,
                    max_logprobs=sampling.MAX_LOGPROBS,
                    arith=common.V1_ARITH,
                )
                self._fuselane_ws = ws
            return ws

        def _kept(self, name: str, key: tuple, build: Callable[[], Any]) -> Any:
            """`build()`'s result, kept while `key` stays the same: its first entry compared by
            identity (a tensor V1 replaces when its contents change; holding it keeps its
            identity from being reused by another tensor), the rest by value."""
            last = self._fuselane_kept.get(name)
            if last is None or last[0][0] is not key[0] or last[0][1:] != key[1:]:
                last = (key, build())
                self._fuselane_kept[name] = last
            return last[1]

        def _bias_tensors(self, proc: Any, B: int, dev: torch.device) -> tuple:
            # The builtin processor replaces bias_tensor whenever its dict changes.
            build = lambda: sampling_state.logit_bias_from_dicts(proc.biases, B, dev)
            return self._kept("bias", (proc.bias_tensor, B, dev), build)

        def _prompt_mask(self, prompt_token_ids: torch.Tensor, B: int, V: int) -> torch.Tensor:
            # V1 builds a new prompt-id tensor only when the batch changes.
            build = lambda: sampling_state.prompt_bin_mask_from_v1(prompt_token_ids[:B], V)
            return self._kept("prompt", (prompt_token_ids, B, V), build)

        def forward(
            self,
            logits: torch.Tensor,
            sampling_metadata: Any,
            predict_bonus_token: bool = False,
            logprobs_mode_override: Any = None,
        ) -> Any:
            md = sampling_metadata
            mode = logprobs_mode_override or self.logprobs_mode
            off = common.fused_sampling_off() is not None
            reason = (
                "startup" if off else _unsupported_v1(self, logits, md, predict_bonus_token, mode)
            )
            return common.route(
                reason,
                lambda: self._fused(logits, md, mode),
                super().forward,
                logits,
                md,
                predict_bonus_token=predict_bonus_token,
                logprobs_mode_override=logprobs_mode_override,
            )

        def _fused(self, logits: torch.Tensor, md: Any, mode: str) -> Any:
            params = _params_v1(self, logits, md)
            n = md.max_num_logprobs
            # V1 penalizes fp32 logits in place itself; without logprobs nothing reads them after.
            out = common.run_fused(self, "v1", logits, params, n, mode, common.V1_WARM_PARAM_SETS)
            if out is None:
                return None
            # No host sync for NaN rows (as on V2): the kernel never samples a NaN (stock V1
            # would sample garbage from NaN probabilities) and the runner can prepare the next
            # step while this one runs. V1 has no output field for the count.
            sampled = out.token_ids.to(torch.int64)  # a copy: the workspace is reused
            return vllm_compat.SamplerOutput(
                sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),
                logprobs_tensors=common._logprobs_tensors(out, sampled, logits, n, torch.int32),
            )

    FuselaneSampler.__qualname__ = FuselaneSampler.__name__
    return FuselaneSampler

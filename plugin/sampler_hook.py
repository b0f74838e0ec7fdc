"""The sampler hook: vLLM's sampling step runs fuselane's fused sampling kernel (issue 5).

Seam (DESIGN.md "Hooking into vLLM"): `install()` (called by `register()` when
FUSELANE_KERNELS has `sampling`) rebinds the module-global name `Sampler` of vLLM's V1 model
runner module (`vllm.v1.worker.gpu_model_runner`; the CPU runner inherits it) to
`FuselaneSampler`, a subclass of vLLM's own `Sampler`, only while the name is still vLLM's class.
The module is usually not imported yet when plugins load, so the rebinding runs from a
post-import hook (a `sys.meta_path` finder that wraps that one module's loader). The runner,
its rejection sampler and its dummy/profile sampler runs get the subclass; vLLM's other
samplers are untouched. The undo restores the name (if it is still ours) and removes the
finder. The V2 runner module (`vllm.v1.worker.gpu.model_runner`) gets only a placeholder
subclass of V2's `Sampler` (fuselane's V2 path is not built yet): it warns when the V2 runner
builds it and runs vLLM's sampler, counted as `stock:v2_runner`.

Per batch (V1 `SamplingMetadata`), `FuselaneSampler.forward` runs `fused_sample` when everything
the batch asks for is supported, else vLLM's own `forward` for the whole batch:

- fused: greedy / random / mixed rows (temperature), top-k, top-p, min-p (vLLM's builtin
  min-p processor's tensor), repetition / frequency / presence penalties (`penalty_state_from_v1`
  from prompt_token_ids + output_token_ids), logit bias (the builtin processor's dict, via
  `logit_bias_from_dicts`), logprobs n in [0, 128] in `raw_logprobs` / `raw_logits`.
- stock (reason counted): spec decode (`predict_bonus_token`, spec_token_ids), allowed token
  ids, bad words, active min_tokens, any non-builtin logits processor, logprob_token_ids,
  max_num_logprobs == -1 or > 128, processed-logprob modes, fp64 gumbel, logits dtype other than
  fp32/bf16/fp16, thinking budget, and any row with NaN logits (the fused result is discarded
  and the batch re-sampled by stock: one host sync per fused step for the NaN check).

Seeded rows: V1 keeps a torch.Generator per seeded request and draws `probs / Exp(1)` from it;
fuselane's kernel draws murmur3 Gumbel noise from an int64 seed. Each step, a seeded row's seed
is a fresh 62-bit integer drawn from the request's own generator (one `randint` on the
generator's device). So the same request seed gives the same tokens run to run, preemption and
batch composition do not matter (the generator's state is per request, as in stock), but the
draws are not stock's bit for bit: the distribution is the same, the tokens are not. Unseeded
rows take the kernel's global-generator seeds.

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

import torch

from . import telemetry, vllm_compat
from .config import KernelSelection

__all__ = ["counters", "install", "make_v1_sampler", "reset_counters"]

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
        p.prompt_bin_mask, p.output_bin_counts, p.output_bin_mask = sampling.penalty_state_from_v1(
            md.prompt_token_ids[:B], md.output_token_ids[:B], V
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
                    rows, V, logits.device, max_logprobs=sampling.MAX_LOGPROBS
                )
                self._fuselane_ws = ws
            return ws

        def _bias_tensors(self, proc: Any, B: int, dev: torch.device) -> tuple:
            # The builtin processor replaces bias_tensor whenever its dict changes.
            key = (proc.bias_tensor, B, dev)
            last = self._fuselane_bias_key
            if last is None or last[0] is not key[0] or last[1:] != key[1:]:
                from fuselane.kernels import sampling

                self._fuselane_bias = sampling.logit_bias_from_dicts(proc.biases, B, dev)
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
            reason = _unsupported_v1(self, logits, md, predict_bonus_token, mode)
            if reason is None:
                out = self._fused(logits, md, mode)
                if out is not None:
                    _count("fused")
                    return out
                reason = "nan_logits"
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
            out = _SAMPLING(
                None,
                sampling.fused_sample,
                logits,
                params,
                workspace=self._workspace(logits),
                num_logprobs=n,
                logprobs_mode=mode,
            )
            if bool(out.nan_rows.any()):  # host sync; stock re-samples the batch
                return None
            sampled = out.token_ids.to(torch.int64)  # a copy: the workspace is reused
            logprobs_tensors = None
            if n is not None:
                ids = [sampled.unsqueeze(-1)]
                lps = [out.logprob.unsqueeze(-1)]
                if n > 0:
                    ids.append(out.topn_ids.clamp(min=0))  # -1 pads rows with < n finite values
                    lps.append(out.topn_logprobs)
                # vLLM's rank: how many raw values are >= the chosen token's (log_softmax and
                # the raw logits order tokens alike).
                raw = logits.to(torch.float32)
                ranks = (raw >= raw.gather(-1, sampled.unsqueeze(-1))).sum(-1)
                logprobs_tensors = vllm_compat.LogprobsTensors(
                    torch.cat(ids, dim=1).to(torch.int32),
                    torch.cat(lps, dim=1).to(torch.float32),
                    ranks,
                )
            return vllm_compat.SamplerOutput(
                sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),
                logprobs_tensors=logprobs_tensors,
            )

    FuselaneSampler.__qualname__ = FuselaneSampler.__name__
    return FuselaneSampler


def make_v2_placeholder(base: type) -> type:
    """vLLM V2's `Sampler` with a warning when the V2 runner builds it: fuselane's V2 path is not
    built yet, so every step runs vLLM's sampler (counted and timed as `impl="stock"`)."""

    class FuselaneV2Sampler(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            vllm_compat.get_logger().warning(
                "fuselane: FUSELANE_KERNELS asks for sampling, but vLLM's V2 model runner is in "
                "use and fuselane's V2 sampler is not built yet: vLLM's own sampler runs "
                "(VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner, which gets fuselane's)"
            )

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _count("stock", "v2_runner")
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
            ours = make_v2_placeholder(stock)
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
            "" if module.__name__ == v2_name else " (sampling kernel active)",
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

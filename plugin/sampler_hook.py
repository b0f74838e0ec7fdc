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
  min-p processor's tensor), repetition / frequency / presence penalties (`sampling_state`: the
  prompt bit mask from prompt_token_ids, kept while V1 keeps that tensor, and the output counts
  from output_token_ids, without presence bits), logit bias (the builtin processor's dict, via
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
from collections.abc import Callable
from typing import Any

from . import vllm_compat
from .config import KernelSelection
from .sampler_common import (
    V1_WARM_PARAM_SETS,
    V2_WARM_PARAM_SETS,
    WARM_LOGPROB_PARAM_SETS,
    _warm_up,
    counters,
    disable_fused_sampling,
    fused_sampling_off,
    reset_counters,
)
from .sampler_v1 import make_v1_sampler
from .sampler_v2 import make_v2_placeholder, make_v2_sampler

__all__ = [
    "V1_WARM_PARAM_SETS",
    "V2_WARM_PARAM_SETS",
    "WARM_LOGPROB_PARAM_SETS",
    "_warm_up",
    "counters",
    "disable_fused_sampling",
    "fused_sampling_off",
    "install",
    "make_v1_sampler",
    "make_v2_placeholder",
    "make_v2_sampler",
    "reset_counters",
]


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

"""TEST-ONLY fault injection: `FUSELANE_FAULT_INJECT` corrupts a kernel family's output.

For tests and canary drills, never for production: with `FUSELANE_FAULT_INJECT=attention`
(comma list of `attention`, `kv_cache`, `sampling`, or `all` / `none`), the plugin damages the
named families' outputs right after their fuselane kernels ran, so that numerical checks fail,
error histograms fill and a canary arm answers differently from stock. The damage is
deterministic and large (far outside every tolerance):

- attention: every output row of the batch gets +1.0;
- kv_cache (plain and RoPE-fused writes): every row the kernel wrote gets +1.0 (in the cache's
  dtype; fp8 caches through a dequantize / requantize round trip);
- sampling: every chosen token id becomes (id + 1) mod vocab.

The corruption is made of torch ops with no host sync, so it is captured into CUDA graphs with
the kernel and replayed with it. Only fuselane's kernels are corrupted, never the stock path,
and the switch works whether telemetry is on or off. The variable is parsed by
`config.parse_fault_inject` (next to FUSELANE_KERNELS); a bad value stops vLLM's start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fuselane.kernels.kv_cache import KVWrite, Rotary

from .config import FAULT_INJECT_ENV_VAR as ENV_VAR
from .config import faults_from_env, parse_fault_inject

__all__ = ["ENV_VAR", "corrupter_for", "faults_from_env", "parse_fault_inject"]

OFFSET = 1.0  # added to corrupted values: far beyond the bf16 tolerance of 2.5e-2

# kernel (telemetry's `kernel` label) -> the family FUSELANE_FAULT_INJECT names
KERNEL_FAMILY = {
    "attention": "attention",
    "kv_cache": "kv_cache",
    "rope_kv_cache": "kv_cache",
    "sampling": "sampling",
}


def _corrupt_cache_rows(cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Add OFFSET to the rows at `slots` (< 0: padding, left alone) of a paged cache view.

    Padding rows are redirected to slot 0 and write its own value back (vLLM keeps block 0 as
    its never-read null block; elsewhere a padding row and a real write to slot 0 in one batch
    would race, acceptable for a test switch).
    """
    if slots.numel() == 0:
        return
    block_size = cache.shape[1]
    valid = slots >= 0
    safe = torch.where(valid, slots.long(), 0)
    block, offset = safe // block_size, safe % block_size
    fp8 = cache.dtype == torch.float8_e4m3fn
    # fp8 rows are gathered and scattered as bytes: not every torch build indexes float8.
    view = cache.view(torch.uint8) if fp8 else cache
    rows = view[block, offset]
    if fp8:
        bumped = (rows.view(cache.dtype).float() + OFFSET).to(cache.dtype).view(torch.uint8)
    else:
        bumped = rows + OFFSET
    mask = valid.view(-1, *([1] * (rows.dim() - 1)))
    view[block, offset] = torch.where(mask, bumped, rows)


def corrupt_attention(result: Any, q: torch.Tensor, key_cache, value_cache, out, *a) -> None:
    """`a`: the call's batch, options and workspace (the damage needs none of them)."""
    del result, q, key_cache, value_cache, a
    out.add_(OFFSET)


def corrupt_kv_cache(result: Any, write: KVWrite) -> None:
    del result
    _corrupt_cache_rows(write.key_cache, write.slot_mapping)
    _corrupt_cache_rows(write.value_cache, write.slot_mapping)


def corrupt_rope_kv_cache(result: Any, rotary: Rotary, write: KVWrite) -> None:
    del rotary
    corrupt_kv_cache(result, write)


def corrupt_sampling(result: Any, logits: torch.Tensor, *a: Any, **k: Any) -> None:
    """`result` is the kernel's SampleOutput; its token_ids are the tokens vLLM receives."""
    del a, k
    vocab = logits.shape[-1]
    result.token_ids.add_(1).remainder_(vocab)


CORRUPTERS: dict[str, Callable[..., None]] = {
    "attention": corrupt_attention,
    "kv_cache": corrupt_kv_cache,
    "rope_kv_cache": corrupt_rope_kv_cache,
    "sampling": corrupt_sampling,
}


def corrupter_for(kernel: str, families: frozenset[str]) -> Callable[..., None] | None:
    """The corrupter of `kernel` when its family is in `families`, else None."""
    family = KERNEL_FAMILY.get(kernel)
    if family is None or family not in families:
        return None
    return CORRUPTERS[kernel]

"""KV-cache update: write new key/value rows into vLLM's paged cache in one launch.

Two operations, each with a torch reference beside it that defines its meaning:

- `kv_cache_update`: vLLM's `do_kv_cache_update` (what `triton_reshape_and_cache_flash` does for
  the flash/Triton layout): row `i < len(slot_mapping)` of key/value goes to cache slot
  `slot_mapping[i]`, i.e. block `slot // block_size`, offset `slot % block_size`; a negative slot
  is a padding token and writes nothing. Key rows past `len(slot_mapping)` are ignored (vLLM's
  V1 runner pads key for CUDA graphs and passes the unpadded slot mapping).
- `rope_kv_cache_update`: vLLM's `do_rope_and_kv_cache_update` hook: rotate query and key in
  place with the rotary embedding (neox or gpt-j pairs, `cos_sin_cache[pos] = [cos | sin]`,
  partial rotary leaves the tail of each head as it is), then write the rotated key and the
  value into the cache, all in one launch.

Cache layout, as vLLM's flash/Triton backends see it: key_cache and value_cache are each
`[num_blocks, block_size, num_kv_heads, head_size]`, any strides but the last (vLLM passes
`kv_cache.transpose(1, 2).split(head_size, dim=-1)` views of one tensor, so K and V of one head
interleave in memory, and the block/head strides depend on the KV-cache layout it picked).

Cache dtypes: the input dtype (fp16, bf16, fp32), or fp8 e4m3 with per-tensor fp32 scales:
`stored = e4m3(saturate(x * (1 / scale), +-448))`, round to nearest even: vLLM's kernel computes
x / scale, which differs by at most one fp32 ulp before the rounding to e4m3. A scale of 0
stores every value as +-448 (x * inf saturates), a NaN scale stores NaN (0x7F), as the
reference does; with `FUSELANE_CHECK_INDICES=1` such scales are refused
(`index_checks.check_scales`).

Launch rule (no autotuning): `_write_launch_config` (tokens per program and warps, from the H200
sweep of run 1; benchmarks/kernels/bench_kv_cache.py's `kv_write_sweep` section re-measures it)
and `_rope_num_warps`. Addressing is picked on the host from shapes and strides alone: int32
offsets unless some offset could pass 2^31 (then int64), and slot * slot_stride where the block
stride is block_size * slot_stride (else block and offset); see `_launch_write`.

Modules: `args` (the bundles `KVWrite` and `Rotary`, and the flat public signatures), `write`
and `rope` (the Triton kernels), `fp8` (their e4m3 helpers), `plan` (launch
rules and addressing), `launch` (host launchers), `checks`, `ops` (the entry points), `reference`.
"""

from __future__ import annotations

from . import args, checks, fp8, launch, ops, plan, reference, rope, write
from .args import KVWrite, Rotary
from .checks import (
    INDEX_DTYPES,
    INPUT_DTYPES,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
)
from .ops import (
    WRITE_LAUNCHES,
    kv_cache_update,
    kv_cache_update_unchecked,
    kv_write,
    kv_write_unchecked,
    rope_kv_cache_update,
    rope_kv_write,
    warm_up_write,
)
from .reference import (
    kv_cache_update_reference,
    kv_write_reference,
    quantize_e4m3_reference,
    rope_kv_cache_update_reference,
    rope_kv_write_reference,
    rotary_reference,
)

__all__ = [
    "INDEX_DTYPES",
    "INPUT_DTYPES",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "WRITE_LAUNCHES",
    "KVWrite",
    "Rotary",
    "args",
    "checks",
    "fp8",
    "kv_cache_update",
    "kv_cache_update_reference",
    "kv_cache_update_unchecked",
    "kv_write",
    "kv_write_reference",
    "kv_write_unchecked",
    "launch",
    "ops",
    "plan",
    "quantize_e4m3_reference",
    "reference",
    "rope",
    "rope_kv_cache_update",
    "rope_kv_cache_update_reference",
    "rope_kv_write",
    "rope_kv_write_reference",
    "rotary_reference",
    "warm_up_write",
    "write",
]

"""fuselane's attention backend for vLLM: backend class, metadata builder and impl.

Shaped like vLLM's TRITON_ATTN backend (`v1/attention/backends/triton_attn.py`), which reads
the same cache layout and the same varlen metadata:

- `FuselaneAttentionBackend`: the class vLLM selects (`AttentionBackendEnum.CUSTOM`; chosen by
  `plugin/selector.py`). Its capability hooks state what the kernels can do, so vLLM's
  `validate_configuration` refuses the rest with a reason and vLLM falls back.
- `FuselaneAttentionMetadataBuilder`: once per step, turns vLLM's `CommonAttentionMetadata`
  into what `paged_attention` takes: device tensors as vLLM keeps them (no copies), the host
  ints `max_query_len` / `max_seq_len` vLLM already has, `min_query_len` from vLLM's host copy
  of the query offsets (no device->host sync either way), and the split-KV workspace allocated
  once in `__init__`.
- `FuselaneAttentionImpl`: a `TritonAttentionImpl` (its constructor: sliding-window, fp8 and
  sinks handling) whose `forward` runs `fuselane.kernels.attention.paged_attention` and whose
  KV write is `kv_write.FuselaneKVWriteMixin` (fuselane's kernel), or TRITON_ATTN's own when
  FUSELANE_KERNELS names attention without kv_cache.

The cache a layer receives is the logical view `[num_blocks, num_kv_heads, block_size,
2 * head_size]` (K half, then V half); the kernels take the `[num_blocks, block_size,
num_kv_heads, head_size]` halves with whatever strides the chosen physical layout gives, so
the backend accepts every layout (`supported_kv_cache_layouts` stays None).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fuselane.kernels import attention as attn_kernels
from fuselane.kernels import kv_cache as kv_kernels

from . import active_selection, selector, telemetry, warmup
from . import vllm_compat as vc
from .kv_write import FP8_MIN_CAPABILITY, SUPPORTED_KV_CACHE_DTYPES, FuselaneKVWriteMixin

# Triton 3.6 on NVIDIA: tl.dot in fp16/bf16 and the bf16 conversions need sm80 (Ampere).
MIN_CAPABILITY = (8, 0)
BACKEND_NAME = "CUSTOM"  # vLLM maps a backend class back to its enum member by this name


def _supported_head_sizes() -> list[int]:
    return sorted(set(attn_kernels.SUPPORTED_HEAD_SIZES) & set(kv_kernels.SUPPORTED_HEAD_SIZES))


def _supported_block_sizes() -> list[int]:
    return sorted(set(attn_kernels.SUPPORTED_BLOCK_SIZES) & set(kv_kernels.SUPPORTED_BLOCK_SIZES))


def _supported_dtypes() -> list[torch.dtype]:
    return [d for d in attn_kernels.SUPPORTED_Q_DTYPES if d in kv_kernels.INPUT_DTYPES]


# Under Triton's interpreter (no GPU) programs run one after another, so splitting a
# sequence's KV only adds programs; 2 keeps the split + reduce path in use at a small cost
# (measured here: a 3-sequence decode launch takes 0.15 s with 2 splits, 3 s with 64).
INTERPRETER_MAX_SPLITS = 2


def workspace_max_splits(device: torch.device) -> int:
    return attn_kernels.DEFAULT_MAX_SPLITS if device.type == "cuda" else INTERPRETER_MAX_SPLITS


def workspace_rows(num_kv_heads: int, device: torch.device, max_seqs: int, decode_qlen: int) -> int:
    """Query rows the split-KV workspace holds (`AttentionWorkspace.allocate`'s max_num_tokens).

    The kernel splits only batches of fewer than `NO_SPLIT_CTAS_PER_SM * SMs` (sequence, kv
    head) programs, so no more sequences than that ever write partials; each contributes
    `decode_qlen` rows (1 + speculative tokens). A bigger batch runs unsplit, and a mixed batch
    whose rows do not fit takes fewer splits (the kernel's rule), so this bound only trades
    memory (here ~35 MB for Hq=32, D=128 on 132 SMs) against splits, never correctness.
    """
    split_seqs = -(
        -attn_kernels.NO_SPLIT_CTAS_PER_SM * attn_kernels.sm_count(device) // num_kv_heads
    )
    return max(1, min(max_seqs, split_seqs)) * decode_qlen


@dataclass
class FuselaneAttentionMetadata:
    """Per-step metadata shared by every layer of one KV-cache group.

    query_start_loc: [B + 1] int32 (device), cu_seqlens of the query tokens
    seq_lens:        [B] int32 (device), KV length of each sequence including its new tokens
    block_table:     [B, max_blocks] int32 (device), kernel-block ids
    slot_mapping:    [T] int64 (device), cache slot of each new token (< 0: padding)
    max_query_len, max_seq_len: host ints from vLLM's scheduler (an upper bound for seq len)
    min_query_len:   host int, shortest non-empty query of a step with prefill rows (0 on
                     decode-only steps, where the kernel does not need it)
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    workspace: Any
    min_query_len: int = 0
    phase: str | None = None  # decode / prefill / mixed for telemetry (None: telemetry off)

    @functools.cached_property
    def batch(self) -> attn_kernels.PagedBatch:
        """The kernels' view of this step (built once, by the step's first layer; its tensors
        are the same objects every layer passes, which lets later layers replay launches)."""
        return attn_kernels.PagedBatch(
            self.query_start_loc, self.seq_lens, self.block_table, self.max_query_len,
            self.min_query_len, self.max_seq_len,
        )  # fmt: skip


class FuselaneAttentionMetadataBuilder(vc.AttentionMetadataBuilder):
    """Builds `FuselaneAttentionMetadata`; owns the split-KV workspace of its KV-cache group."""

    # A full CUDA graph replays the launches captured for one batch shape with other lengths.
    # The kernels' grids and configs depend only on shapes (and the host max_query_len, which
    # picks decode-only vs decode+prefill launches), every program reads the lengths on the
    # device, and each path is exact for any query lengths, so any batch, mixed ones included,
    # replays correctly (tests/plugin/test_backend_direct.py checks a mixed batch run through
    # the decode-only plan). Hence ALWAYS, like TRITON_ATTN.
    _cudagraph_support: ClassVar = vc.AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_heads_q = vc.num_query_heads(vllm_config, layer_names)
        self.head_size = kv_cache_spec.head_size
        self.decode_query_len = vc.decode_query_len(vllm_config)
        # Split-KV partials of every layer and step; allocated once, here.
        self.workspace = attn_kernels.AttentionWorkspace.allocate(
            workspace_rows(
                kv_cache_spec.num_kv_heads,
                torch.device(device),
                vc.max_num_seqs(vllm_config),
                vc.decode_query_len(vllm_config),
            ),
            self.num_heads_q,
            self.head_size,
            device,
            max_splits=workspace_max_splits(torch.device(device)),
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> FuselaneAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise NotImplementedError("fuselane attention is causal only (non-causal batch)")
        return FuselaneAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            workspace=self.workspace,
            min_query_len=min_query_len(cm.query_start_loc_cpu) if cm.max_query_len > 1 else 0,
            # Host tensor, no sync; a no-op returning None when telemetry is off.
            phase=telemetry.note_step(cm.query_start_loc_cpu, self.decode_query_len),
        )


def min_query_len(query_start_loc_cpu: torch.Tensor) -> int:
    """The shortest query of a step among requests that have one (0: none), from vLLM's host
    `query_start_loc [num_reqs + 1]`; requests of CUDA-graph padding have none."""
    lens = np.diff(query_start_loc_cpu.numpy())
    lens = lens[lens > 0]
    return int(lens.min()) if lens.size else 0


# Telemetry seam: a plain call of the kernel when telemetry is off and no fault is injected.
_ATTENTION = telemetry.seam(telemetry.ATTENTION)


class FuselaneAttentionImpl(FuselaneKVWriteMixin, vc.TritonAttentionImpl):
    """TRITON_ATTN's impl with fuselane's paged attention and (by default) KV write."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: Any = None,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        attn_type = attn_type if attn_type is not None else vc.AttentionType.DECODER
        if alibi_slopes is not None:
            raise NotImplementedError("fuselane attention: ALiBi slopes are not supported")
        if attn_type != vc.AttentionType.DECODER:
            raise NotImplementedError(f"fuselane attention: attn_type {attn_type} not supported")
        if kwargs.get("use_alibi_sqrt") or kwargs.get("chunk_lookback", -1) > -1:
            raise NotImplementedError("fuselane attention: alibi_sqrt / chunk_lookback unsupported")
        super().__init__(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
            **kwargs,
        )  # fmt: skip
        # The kernel takes the model's window (None: full attention), not TRITON_ATTN's
        # (window - 1, 0) pair.
        self._fuselane_window = sliding_window
        # Queries stay in the model dtype: the kernel does not read fp8 queries.
        self.supports_quant_query_input = False
        self._fuselane_kv_write = active_selection().backend_writes_kv_cache
        self._fuselane_warmed = False
        self._fuselane_checked = False
        self._fuselane_opts: attn_kernels.AttentionOptions | None = None

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # Sinks are learned per-head logits; the kernel reads them as fp32.
        if self.sinks is not None and self.sinks.dtype != torch.float32:
            self.sinks = self.sinks.detach().float()
        self._fuselane_opts = None  # built again from the loaded sinks

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FuselaneAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D]; key/value [T, Hkv, D] (written to the cache here); output [T, Hq, D].

        Rows of `output` past `num_actual_tokens` (CUDA-graph padding) are left as they are.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fuselane attention: fused output quantization unsupported")
        if attn_metadata is None:
            # vLLM's profiling run: no metadata, no cache to read.
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = self._fuselane_caches(kv_cache)
        k_scale, v_scale = self._fuselane_scales(layer)
        if not self._fuselane_warmed:
            self._fuselane_warm_up(query, key_cache, value_cache, md, k_scale, v_scale)
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            # The backend declares forward_includes_kv_cache_update: the write happens here, so
            # vLLM has no separate KV-update op per layer (one eager op fewer between its
            # piecewise CUDA graphs on prefill and mixed steps). Rows past the slot mapping's
            # length (graph padding) are not written.
            if self._fuselane_kv_write:
                self._fuselane_write(
                    kv_kernels.KVWrite(
                        key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale
                    )
                )
            else:
                self.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
        args = (query[:n], key_cache, value_cache, output[:n], md.batch,
                self._fuselane_options(k_scale, v_scale), md.workspace)  # fmt: skip
        if self._fuselane_checked:
            # This layer's arguments were validated on its first call; what changes between
            # steps (batch sizes) is vLLM's contract. Saves host time on every eager layer.
            _ATTENTION(md.phase, attn_kernels.attention_unchecked, *args)
        else:
            _ATTENTION(md.phase, attn_kernels.attention, *args)
            self._fuselane_checked = True
        return output

    def _fuselane_options(
        self, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
    ) -> attn_kernels.AttentionOptions:
        """This layer's `AttentionOptions`, built once (its scales are the same tensors every
        step; a new pair, after a reload, builds new options)."""
        options = self._fuselane_opts
        if options is None or options.k_scale is not k_scale or options.v_scale is not v_scale:
            options = self._fuselane_opts = attn_kernels.AttentionOptions(
                scale=self.scale,
                sliding_window=self._fuselane_window,
                softcap=self.logits_soft_cap or 0.0,
                sinks=self.sinks,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return options

    def _fuselane_warm_up(self, query, key_cache, value_cache, md, k_scale, v_scale) -> None:
        """Compile every attention variant of this layer configuration now (plugin/warmup.py);
        once per layer (a CUDA-graph capture defers it to the next eager call)."""
        softcap = self.logits_soft_cap or 0.0
        key = (
            "attention", str(query.device), query.dtype, query.shape[1], key_cache.dtype,
            tuple(key_cache.shape[1:]), key_cache.stride(), md.block_table.stride(0) % 16 == 0,
            self._fuselane_window, softcap > 0, self.sinks is not None, md.workspace is None,
        )  # fmt: skip
        done = warmup.once(
            "attention",
            key,
            query.device,
            lambda: attn_kernels.warm_up(
                key_cache,
                value_cache,
                md.block_table[:1],
                num_q_heads=query.shape[1],
                q_dtype=query.dtype,
                options=self._fuselane_options(k_scale, v_scale),
                workspace=md.workspace,
                strict=selector.custom_named(),
            ),
        )
        off = attn_kernels.hopper_kernels_off()
        if (
            off is not None
            and query.is_cuda
            and torch.cuda.get_device_capability(query.device)[0] == 9
        ):
            warmup.say_once(
                ("hopper-off", off),
                "fuselane: Hopper's warp-specialized attention kernels are off (%s); the "
                "Triton kernels run every batch",
                off,
            )
        if self._fuselane_kv_write and not self._writes_no_cache():
            kv_key = ("kv_cache", str(query.device), query.dtype, key_cache.dtype,
                      tuple(key_cache.shape[1:]), key_cache.stride())  # fmt: skip
            done = done and warmup.once(
                "kv_cache",
                kv_key,
                query.device,
                lambda: kv_kernels.warm_up_write(
                    key_cache,
                    value_cache,
                    key_dtype=query.dtype,
                    k_scale=k_scale,
                    v_scale=v_scale,
                ),
            )
        self._fuselane_warmed = done


class FuselaneAttentionBackend(vc.KVCacheShapeHooks, vc.AttentionBackend):
    """fuselane's paged attention + KV-cache write, selectable as `CUSTOM`.

    `vc.KVCacheShapeHooks`: the KV-cache allocation hooks vLLM 0.26 requires (TRITON_ATTN's);
    empty on 0.32/0.33.
    """

    # forward() writes the new tokens' K/V itself (FuselaneAttentionImpl.forward): vLLM then
    # calls no separate unified_kv_cache_update, an eager op of its own on every layer.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = _supported_dtypes()
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[FuselaneAttentionImpl]:
        return FuselaneAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FuselaneAttentionMetadataBuilder]:
        return FuselaneAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        # Exact sizes: vLLM splits a larger cache block (the CPU platform's 128) into these.
        return _supported_block_sizes()

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return _supported_head_sizes()

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == vc.AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        # None: no GPU (the CPU platform); the kernels run under Triton's interpreter there.
        if capability is None:
            return True
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> str | None:
        kv_dtype = kv_cache_dtype or "auto"
        named = {"float16": torch.float16, "bfloat16": torch.bfloat16}
        if kv_dtype in named and named[kv_dtype] != dtype:
            return f"kv_cache_dtype {kv_dtype} differs from the model dtype {dtype}"
        if vc.is_fp8_kv_cache(kv_dtype):
            if not vc.platform_fp8_is_e4m3fn():
                return "fp8 KV cache needs float8_e4m3fn"
            if device_capability is not None and (
                (device_capability.major, device_capability.minor) < FP8_MIN_CAPABILITY
            ):
                return f"fp8 KV cache needs compute capability >= {FP8_MIN_CAPABILITY}"
        return None

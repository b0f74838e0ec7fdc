"""fuselane's backend called directly, the way vLLM's model runner calls it, against vLLM's own.

Each case builds real vLLM `Attention` layers (one on fuselane's backend, one on the CPU
platform's stock CPU_ATTN), a `CommonAttentionMetadata` for a mixed batch (decodes, a
speculative-verify-sized query, prefill chunks with and without cached context), runs each
backend's own metadata builder and then its impl: KV write of the cached context, KV write of
the new tokens, attention. Outputs must agree; each cache holds what its backend wrote in its
own format. fuselane's cache is read back through the kernels' torch reference too.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from fuselane.kernels import attention as attn_kernels
from fuselane.kernels import kv_cache as kv_kernels
from tests.allclose import TOLERANCES, assert_close

HQ, HKV, D = 4, 2, 64
BLOCK = 32
NUM_BLOCKS = 48
# (cached context, new query tokens) per request: decodes, a 5-token verify, a prefill chunk
# after cached context, a fresh prefill crossing block boundaries, a decode at a block edge.
MIXED = [(40, 1), (95, 1), (20, 5), (70, 12), (0, 37), (63, 1)]
# A prefill step: chunks only (the attention call leaves out its decode launch).
PREFILL = [(70, 12), (0, 37), (25, 20)]
PAD_ROWS = 3  # CUDA-graph style padding rows after the real tokens

DTYPES = [d for d in (torch.float16, torch.float32) if d in attn_kernels.SUPPORTED_Q_DTYPES]


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    import fuselane.plugin as plugin

    config = EngineArgs(
        model=str(tiny_model), dtype="float16", block_size=BLOCK, max_model_len=512
    ).create_engine_config()  # loads the general plugins: fuselane registers in this process
    yield config
    plugin.unregister()


def _batch(spec, gen):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = [c + q for c, q in spec]
    q_lens = [q for _, q in spec]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    max_blocks = max(math.ceil(s / BLOCK) for s in seq_lens)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    block_table = torch.zeros(len(spec), max_blocks, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        for i in range(math.ceil(s / BLOCK)):
            block_table[b, i] = perm.pop()

    def slots(b, positions):
        return [int(block_table[b, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]

    ctx_slots, new_slots = [], []
    for b, (c, q) in enumerate(spec):
        ctx_slots += slots(b, range(c))
        new_slots += slots(b, range(c, c + q))
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(spec),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
    )
    return common, torch.tensor(ctx_slots, dtype=torch.int64)


def _layer(config, backend, prefix, dtype, **kwargs):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    cache_config = dataclasses.replace(config.cache_config, cache_dtype=kwargs.pop("kv", "auto"))
    default = torch.get_default_dtype()
    with set_current_vllm_config(config):
        torch.set_default_dtype(dtype)  # vLLM builds layers under the model dtype
        try:
            layer = Attention(
                HQ, D, D**-0.5, HKV, cache_config=cache_config, prefix=prefix,
                attn_backend=backend, **kwargs,
            )  # fmt: skip
        finally:
            torch.set_default_dtype(default)
        layer.process_weights_after_loading(dtype)
        builder = backend.get_builder_cls()(
            layer.get_kv_cache_spec(config), [prefix], config, torch.device("cpu")
        )
    return layer, builder


def _run(config, layer, builder, kv_cache, common, ctx_slots, kv_ctx, qkv_new, pad_kv=True):
    """The runner's order of calls: context write, new-token write (by vLLM's separate
    KV-update op, or inside forward for a backend that declares
    forward_includes_kv_cache_update, as fuselane's does), build, forward.

    With `pad_kv` the write gets the padded key/value rows and the unpadded slot mapping, as
    vLLM's GPU runner passes them under CUDA graphs (fuselane's write takes that; CPU_ATTN's
    reads one slot per key row, so it gets the real rows only).
    """
    from vllm.config import set_current_vllm_config

    k_ctx, v_ctx = kv_ctx
    q, k, v = qkv_new
    n = common.num_actual_tokens
    with set_current_vllm_config(config):
        layer.impl.do_kv_cache_update(layer, k_ctx, v_ctx, kv_cache, ctx_slots)
        k_w, v_w = (k, v) if pad_kv else (k[:n], v[:n])
        if not layer.attn_backend.forward_includes_kv_cache_update:
            layer.impl.do_kv_cache_update(layer, k_w, v_w, kv_cache, common.slot_mapping)
        md = builder.build(0, common)
        out = torch.full_like(q, float("nan"))
        layer.impl.forward(layer, q, k, v, kv_cache, md, out)
    return out, md


def _inputs(spec, dtype, gen):
    t_ctx = sum(c for c, _ in spec)
    t_new = sum(q for _, q in spec) + PAD_ROWS

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # q/k/v of the new tokens are views of one fused QKV tensor, as the model produces them.
    qkv = randn(t_new, (HQ + 2 * HKV) * D)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    new = (q.view(t_new, HQ, D), k.view(t_new, HKV, D), v.view(t_new, HKV, D))
    return (randn(t_ctx, HKV, D), randn(t_ctx, HKV, D)), new


def _fuselane_cache(dtype):
    # The logical [num_blocks, Hkv, block, 2D] view of a physically NHD cache: strided halves.
    physical = torch.full((NUM_BLOCKS, BLOCK, HKV, 2 * D), float("nan"), dtype=dtype)
    return physical.permute(0, 2, 1, 3)


CASES = {
    "plain": {},
    "sliding_window": {"per_layer_sliding_window": 40},
    "softcap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": "sinks"},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_matches_cpu_attn(vllm_config, dtype, case):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from fuselane.plugin.backend import FuselaneAttentionBackend

    gen = torch.Generator().manual_seed(list(CASES).index(case))
    kwargs = dict(CASES[case])
    if kwargs.get("sinks") == "sinks":
        kwargs["sinks"] = torch.randn(HQ, generator=gen).to(dtype)  # a model-dtype parameter
    common, ctx_slots = _batch(MIXED, gen)
    kv_ctx, new = _inputs(MIXED, dtype, gen)
    n = common.num_actual_tokens

    fl_layer, fl_builder = _layer(
        vllm_config, FuselaneAttentionBackend, f"fl.{case}.{str(dtype)[6:]}", dtype, **kwargs
    )
    fl_cache = _fuselane_cache(dtype)
    fl_out, fl_md = _run(
        vllm_config, fl_layer, fl_builder, fl_cache, common, ctx_slots, kv_ctx, new
    )

    cpu_layer, cpu_builder = _layer(
        vllm_config, CPUAttentionBackend, f"cpu.{case}.{str(dtype)[6:]}", dtype, **kwargs
    )
    cpu_cache = torch.zeros(NUM_BLOCKS, HKV, BLOCK, 2 * D, dtype=dtype)
    cpu_out, _ = _run(
        vllm_config, cpu_layer, cpu_builder, cpu_cache, common, ctx_slots, kv_ctx, new, False
    )

    atol, rtol = TOLERANCES[dtype]
    assert_close(
        fl_out[:n], cpu_out[:n], atol=atol, rtol=rtol, what=f"fuselane vs CPU_ATTN ({case})"
    )
    assert torch.isnan(fl_out[n:]).all(), "padding rows of the output were written"

    # What fuselane's write stored, read back by the kernels' reference.
    key_cache, value_cache = fl_cache.transpose(1, 2).split(D, dim=-1)
    ref = torch.full_like(new[0], float("nan"))
    attn_kernels.paged_attention_reference(
        new[0][:n], key_cache, value_cache, ref[:n], common.query_start_loc, common.seq_lens,
        common.block_table_tensor, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len, scale=D**-0.5,
        sliding_window=kwargs.get("per_layer_sliding_window"),
        softcap=kwargs.get("logits_soft_cap", 0.0),
        sinks=None if "sinks" not in kwargs else kwargs["sinks"].float(),
    )  # fmt: skip
    assert_close(fl_out[:n], ref[:n], atol=atol, rtol=rtol, what=f"fuselane vs reference ({case})")

    # The metadata is vLLM's own tensors plus host ints: nothing copied, nothing synced.
    assert fl_md.seq_lens is common.seq_lens and fl_md.block_table is common.block_table_tensor
    assert fl_md.max_query_len == max(q for _, q in MIXED) and fl_md.num_actual_tokens == n
    assert fl_md.min_query_len == min(q for _, q in MIXED)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_step_matches_cpu_attn(vllm_config, dtype):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from fuselane.plugin.backend import FuselaneAttentionBackend

    gen = torch.Generator().manual_seed(17)
    common, ctx_slots = _batch(PREFILL, gen)
    kv_ctx, new = _inputs(PREFILL, dtype, gen)
    n = common.num_actual_tokens
    outs = []
    for backend, cache in (
        (FuselaneAttentionBackend, _fuselane_cache(dtype)),
        (CPUAttentionBackend, torch.zeros(NUM_BLOCKS, HKV, BLOCK, 2 * D, dtype=dtype)),
    ):
        prefix = f"prefill.{backend.get_name()}.{str(dtype)[6:]}"
        layer, builder = _layer(vllm_config, backend, prefix, dtype)
        fuselane = backend is FuselaneAttentionBackend
        out, md = _run(vllm_config, layer, builder, cache, common, ctx_slots, kv_ctx, new, fuselane)
        outs.append(out)
        if fuselane:
            assert md.min_query_len == 12 and md.max_query_len == 37
    atol, rtol = TOLERANCES[dtype]
    assert_close(outs[0][:n], outs[1][:n], atol=atol, rtol=rtol, what="prefill step")
    assert torch.isnan(outs[0][n:]).all(), "padding rows of the output were written"


def test_min_query_len_ignores_requests_without_queries():
    from fuselane.plugin.backend import min_query_len

    assert min_query_len(torch.tensor([0, 5, 5, 12, 12], dtype=torch.int32)) == 5
    assert min_query_len(torch.tensor([0, 0, 0], dtype=torch.int32)) == 0
    assert min_query_len(torch.tensor([0], dtype=torch.int32)) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graph_replay_with_other_query_lengths_stays_exact(vllm_config, dtype):
    """AttentionCGSupport.ALWAYS: a launch planned for one batch (here: all decodes, as in a
    captured decode graph) must stay exact when a mixed batch is replayed through it."""
    from fuselane.plugin.backend import FuselaneAttentionBackend

    gen = torch.Generator().manual_seed(7)
    common, ctx_slots = _batch(MIXED, gen)
    kv_ctx, new = _inputs(MIXED, dtype, gen)
    n = common.num_actual_tokens
    layer, builder = _layer(
        vllm_config, FuselaneAttentionBackend, f"fl.graph.{str(dtype)[6:]}", dtype
    )
    cache = _fuselane_cache(dtype)
    out, md = _run(vllm_config, layer, builder, cache, common, ctx_slots, kv_ctx, new)
    replay = torch.full_like(out, float("nan"))
    layer.impl.forward(layer, *new, cache, dataclasses.replace(md, max_query_len=1), replay)
    atol, rtol = TOLERANCES[dtype]
    assert_close(replay[:n], out[:n], atol=atol, rtol=rtol, what="decode-only plan, mixed batch")


def test_fp8_cache_write_and_read_use_the_layer_scales(vllm_config):
    from fuselane.plugin.backend import FuselaneAttentionBackend

    dtype = torch.float16
    gen = torch.Generator().manual_seed(3)
    common, ctx_slots = _batch(MIXED, gen)
    kv_ctx, new = _inputs(MIXED, dtype, gen)
    n = common.num_actual_tokens
    layer, builder = _layer(vllm_config, FuselaneAttentionBackend, "fl.fp8", dtype, kv="fp8")
    layer._k_scale.fill_(0.5)
    layer._v_scale.fill_(0.25)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, HKV, 2 * D, dtype=torch.uint8).permute(0, 2, 1, 3)
    out, _ = _run(vllm_config, layer, builder, cache, common, ctx_slots, kv_ctx, new)

    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    key_cache, value_cache = (
        key_cache.view(torch.float8_e4m3fn),
        value_cache.view(torch.float8_e4m3fn),
    )
    # The new tokens' rows hold e4m3(k / k_scale), e4m3(v / v_scale).
    slots = common.slot_mapping
    stored_k = key_cache[slots // BLOCK, slots % BLOCK]
    want_k = kv_kernels.quantize_e4m3_reference(new[1][:n], layer._k_scale)
    assert torch.equal(stored_k.view(torch.uint8), want_k.view(torch.uint8))
    ref = torch.full_like(out, float("nan"))
    attn_kernels.paged_attention_reference(
        new[0][:n], key_cache, value_cache, ref[:n], common.query_start_loc, common.seq_lens,
        common.block_table_tensor, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len, scale=D**-0.5, k_scale=layer._k_scale,
        v_scale=layer._v_scale,
    )  # fmt: skip
    assert_close(out[:n], ref[:n], atol=2e-2, rtol=2e-2, what="fp8 cache attention")


# --- FUSELANE_KERNELS=kv_cache alone: a stock backend with only its KV write replaced ----------


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


def test_kv_write_subclass_of_triton_attn(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
    )

    from fuselane.plugin import kv_write

    cls = kv_write.kv_write_backend("TRITON_ATTN")
    assert issubclass(cls, TritonAttentionBackend) and cls.get_name() == "TRITON_ATTN"
    impl_cls = cls.get_impl_cls()
    assert impl_cls.forward is TritonAttentionImpl.forward  # attention stays vLLM's
    assert cls.get_supported_kernel_block_sizes() == [16, 32, 64]
    with set_current_vllm_config(vllm_config):
        impl = impl_cls(HQ, D, D**-0.5, HKV, None, None, "auto")
    assert impl.fused_rope_kvcache_supported()

    dtype = torch.float16
    gen = torch.Generator().manual_seed(11)
    common, _ = _batch(MIXED, gen)
    _, (q, k, v) = _inputs(MIXED, dtype, gen)
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    slots = common.slot_mapping.clone()
    slots[3] = -1  # a padding token: written nowhere

    cache = _fuselane_cache(dtype)
    want = cache.clone()
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    kv_kernels.kv_cache_update_reference(k, v, *want.transpose(1, 2).split(D, dim=-1), slots)
    assert _nan_equal(cache, want)

    # The fused RoPE + write hook: rotates q and k in place, writes the rotated k.
    positions = torch.randint(0, 500, (k.shape[0],), generator=gen)
    cos_sin = torch.randn(512, D, generator=gen)
    cache, want = _fuselane_cache(dtype), _fuselane_cache(dtype)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    impl.do_rope_and_kv_cache_update(layer, q1, k1, v, positions, cos_sin, True, cache, slots)
    kv_kernels.rope_kv_cache_update_reference(
        positions, q2, k2, v, cos_sin, True, *want.transpose(1, 2).split(D, dim=-1), slots
    )
    atol, rtol = TOLERANCES[dtype]
    assert_close(q1, q2, atol=atol, rtol=rtol, what="rotated query")
    assert_close(k1, k2, atol=atol, rtol=rtol, what="rotated key")
    got_k = cache.transpose(1, 2)[..., :D][
        common.slot_mapping[:3] // BLOCK, common.slot_mapping[:3] % BLOCK
    ]
    assert_close(got_k, k1[:3], atol=0, rtol=0, what="cached rotated key")


def test_kv_write_subclasses_resolve_by_path():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from fuselane.plugin import kv_write

    cls = resolve_obj_by_qualname("fuselane.plugin.kv_write.KVWrite_TRITON_ATTN")
    assert cls is kv_write.kv_write_backend("TRITON_ATTN")
    with pytest.raises(ValueError, match="stock_name: expected one of"):
        kv_write.kv_write_backend("CPU_ATTN")

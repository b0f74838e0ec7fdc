"""V1's per-request sampling state as the fused sampler's tensors (plugin/sampling_state.py):
built without a host sync on a GPU, which would stall vLLM's asynchronous scheduling."""

from __future__ import annotations

import pytest
import torch

from fuselane.plugin import sampling_state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_v1_state_is_built_without_a_stream_sync():
    vocab = 151_936
    lists = [[7, 9, -1], [], list(range(300))]
    prompts = torch.tensor([[1, 2, vocab], [3, vocab, vocab], [5, 6, 7]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts, mask = sampling_state.output_state_from_v1(lists, vocab, "cuda")
        prompt_mask = sampling_state.prompt_bin_mask_from_v1(prompts, vocab)
        bias = sampling_state.logit_bias_from_dicts({1: {4: 0.5}}, 3, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.device.type == mask.device.type == prompt_mask.device.type == "cuda"
    assert counts[2].sum().item() == 300 and counts[0, 7].item() == 1
    assert bias[0].tolist() == [0, 1, 0]


def test_to_device_keeps_cpu_tensors_where_they_are():
    t = torch.arange(4)
    assert torch.equal(sampling_state.to_device(t, "cpu"), t)

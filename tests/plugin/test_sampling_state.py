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
        kept = sampling_state.OutputCounts()
        kept.update(lists, vocab, torch.device("cuda"))
        lists[0][-1] = 11  # the placeholder filled in, a new one appended
        lists[0].append(-1)
        kept_counts = kept.update(lists, vocab, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.device.type == mask.device.type == prompt_mask.device.type == "cuda"
    assert counts[2].sum().item() == 300 and counts[0, 7].item() == 1
    assert bias[0].tolist() == [0, 1, 0]
    assert kept_counts[0, 11].item() == 1 and kept_counts[2].sum().item() == 300


def test_to_device_keeps_cpu_tensors_where_they_are():
    t = torch.arange(4)
    assert torch.equal(sampling_state.to_device(t, "cpu"), t)


def _from_scratch(lists: list, vocab: int) -> torch.Tensor:
    return sampling_state.output_state_from_v1(lists, vocab, "cpu", with_mask=False)[0]


def test_output_counts_kept_across_steps_match_a_rebuild():
    """V1's lists over many steps (appends, async placeholders filled in later, rows swapped,
    finished and new requests, dropped ids, a batch outgrowing the kept rows): the counts kept
    step to step equal the counts built from all the lists, every step."""
    vocab, rng = 50, torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    lists = [rand(i) for i in range(3)]
    kept = sampling_state.OutputCounts()
    for step in range(300):
        op = int(torch.randint(0, 8, (1,), generator=rng))
        i = int(torch.randint(0, len(lists), (1,), generator=rng))
        j = int(torch.randint(0, len(lists), (1,), generator=rng))
        if op == 0:  # two rows swapped (the batch condensed)
            lists[i], lists[j] = lists[j], lists[i]
        elif op == 1 and len(lists) > 1:  # a request finished: the last row moves up
            lists[i] = lists[-1]
            lists.pop()
        elif op == 2:  # a new request, sometimes past the rows kept so far
            lists.append(rand(int(torch.randint(0, 4, (1,), generator=rng))))
        elif op == 3 and lists[i]:  # ids dropped after a KV-load failure, then one sampled
            del lists[i][-int(torch.randint(1, len(lists[i]) + 1, (1,), generator=rng)) :]
            lists[i] += rand(1)
        elif op == 4:  # a new request in an old row
            lists[i] = rand(2)
        for row in lists:  # every step: the trailing placeholders filled in or not, one more
            if row and row[-1] == -1 and int(torch.randint(0, 2, (1,), generator=rng)):
                while -1 in row:
                    row[row.index(-1)] = rand(1)[0]
            pending = bool(row) and row[-1] == -1  # placeholders stay trailing
            row.append(
                -1 if pending or int(torch.randint(0, 3, (1,), generator=rng)) == 0 else rand(1)[0]
            )
        B = len(lists) - int(torch.randint(0, 2, (1,), generator=rng))  # a partial batch too
        got = kept.update(lists[:B], vocab, torch.device("cpu"))
        assert got.shape == (B, vocab) and got.stride() == (vocab, 1)
        assert torch.equal(got, _from_scratch(lists[:B], vocab)), step

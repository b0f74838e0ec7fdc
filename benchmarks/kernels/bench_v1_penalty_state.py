"""Per-step cost of the penalty state fuselane's sampler builds on vLLM's V1 runner (GPU).

V1 hands the sampler its output token ids as Python lists every step; the fused kernel reads
output counts [B, V] (and optionally their packed presence bits) and a packed prompt mask. This
times, at Qwen2.5's vocabulary (151,936) and B rows of L output ids, each piece of that build
against the kernel itself:

- `OutputCounts.update` at the next step (one more id on every row: what the sampler does each
  step), against `output_state_from_v1`, with the presence bits and without: numpy padding of
  all the lists, the pinned copy, the counts' scatter and, with bits, `pack_bin_mask`;
- `pack_bin_mask` alone, the prompt mask (built again whenever V1 rebuilds its prompt tensor),
  the counts' scatter alone (the GPU part);
- `fused_sample` with T 0.8 / top-k 50 / top-p 0.95 and repetition penalty 1.1, in place
  (`logits_writable`, as V1 calls it), reading the counts through the presence bits and densely.

Wall time per call (host and GPU, synchronized after the loop), mean of --reps calls after one
warm call: the build runs on the host thread in the sampler's step, so its host time counts.

    python3 benchmarks/kernels/bench_v1_penalty_state.py --out DIR [--cases 256x300,512x300]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.kernels import sampling as smp
from fuselane.plugin import sampling_state as ss

VOCAB = 151936  # Qwen2.5's
PROMPT_LEN = 128


def _ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return round((time.perf_counter() - start) / reps * 1e3, 3)


def run_case(B: int, L: int, V: int, device: torch.device, reps: int) -> dict[str, float]:
    """Milliseconds per call of each piece at B rows of L output ids over a V vocabulary."""
    g = torch.Generator().manual_seed(0)
    outputs = [torch.randint(0, V, (L,), generator=g).tolist() for _ in range(B)]
    prompt = torch.randint(0, V, (B, PROMPT_LEN), generator=g).to(device)
    ids = ss.to_device(torch.tensor(outputs, dtype=torch.int64), device)
    counts, bits = ss.output_state_from_v1(outputs, V, device)

    def scatter_only() -> torch.Tensor:
        c = torch.zeros(B, V, dtype=torch.int32, device=device)
        return c.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))

    f = {"device": device}
    params = smp.SamplingParamsTensors(
        temperature=torch.full((B,), 0.8, **f), top_k=torch.full((B,), 50, dtype=torch.int32, **f),
        top_p=torch.full((B,), 0.95, **f), repetition_penalty=torch.full((B,), 1.1, **f),
        frequency_penalty=torch.zeros(B, **f), presence_penalty=torch.zeros(B, **f),
        prompt_bin_mask=ss.prompt_bin_mask_from_v1(prompt, V), output_bin_counts=counts,
        output_bin_mask=bits,
    )  # fmt: skip
    dense = smp.SamplingParamsTensors(**{**params.__dict__, "output_bin_mask": None})
    logits = torch.randn(B, V, generator=g).to(device)
    ws = smp.SamplingWorkspace.allocate(B, V, device)

    def sample(p: smp.SamplingParamsTensors) -> Callable[[], object]:
        return lambda: smp.fused_sample(
            logits.clone(), p, workspace=ws, num_logprobs=None, logits_writable=True
        )

    kept = ss.OutputCounts()
    kept.update(outputs, V, device)
    steps = iter(torch.randint(0, V, (reps + 1, B), generator=g).tolist())

    def next_step() -> torch.Tensor:  # V1's next step: one more id on every row
        for row, token in zip(outputs, next(steps), strict=True):
            row.append(token)
        return kept.update(outputs, V, device)

    times = {
        "output_state_with_bits_ms": _ms(
            lambda: ss.output_state_from_v1(outputs, V, device), reps, device
        ),
        "output_state_counts_only_ms": _ms(
            lambda: ss.output_state_from_v1(outputs, V, device, with_mask=False), reps, device
        ),
        "pack_bin_mask_ms": _ms(lambda: smp.pack_bin_mask(counts > 0), reps, device),
        "prompt_mask_ms": _ms(lambda: ss.prompt_bin_mask_from_v1(prompt, V), reps, device),
        "counts_scatter_only_ms": _ms(scatter_only, reps, device),
        "logits_clone_ms": _ms(lambda: logits.clone(), reps, device),
        "fused_sample_with_bits_ms": _ms(sample(params), reps, device),
        "fused_sample_dense_counts_ms": _ms(sample(dense), reps, device),
    }  # fmt: skip
    # last: it lengthens the lists the others read
    times["counts_kept_next_step_ms"] = _ms(next_step, reps, device)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="256x300,512x300", help="BxL list (rows x output ids)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="plumbing check on the CPU (interpreter)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU here (--cpu runs the plumbing under Triton's interpreter)")
    result = {"benchmark": "v1_penalty_state", "date": date.today().isoformat(),
              **harness.device_info(), "vocab": args.vocab, "cases": {}}  # fmt: skip
    for case in args.cases.split(","):
        B, L = (int(x) for x in case.split("x"))
        result["cases"][case] = run_case(B, L, args.vocab, device, args.reps)
        print(case, result["cases"][case], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cpu" if args.cpu else harness.device_info()["device"].split()[1].lower()
    path = args.out / f"v1-penalty-state-{name}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far two correct bf16 attention implementations disagree on a model of the matrix (CPU).

The greedy verdict of `run_e2e.py` compares fuselane's prompt and output log-probabilities with
FLASH_ATTN's on random weights (the correctness pass's re-init: N(0, WEIGHT_STD), norms 1,
biases 0), bounded by twice TRITON_ATTN's deviation. How large any bf16 deviation grows depends
on the model: this runs one model's config (from `models/`) twice in bf16 with Hugging Face
transformers, once per attention implementation (`eager`: matmul and softmax; `sdpa`: torch's
fused kernel), on the same weights and prompt, and reports the mean |difference| of the prompt
log-probabilities by position band. Both implementations are correct; what they differ by is
what the model makes of bf16 rounding in attention alone.

    python benchmarks/e2e/rounding_sensitivity.py --model gemma-2-9b [--layers 21]
        [--tokens 512] [--impls eager sdpa] [--out DIR]

`--layers` shortens the model (the full Gemma-2-9B does not fit 24 GB of CPU memory twice);
`--vocab` shrinks the vocabulary (the embedding and the logits only). Writes
DIR/rounding-sensitivity-cpu-<model>[-<layers>l].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# The folder's parts, by bare name (as run_e2e.py imports them).
from correctness import WEIGHT_SEED, WEIGHT_STD, reinit_weights  # noqa: E402
from workload_sets import resolve_model  # noqa: E402

# Position bands of the report: [start, end) of the scored positions (position p scores token p).
BANDS = ((1, 16), (16, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 4096))


def load_config(model: Path, layers: int | None, vocab: int | None) -> Any:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model)
    if layers:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[:layers]
    if vocab:
        cfg.vocab_size = vocab
    return cfg


def prompt_logprobs(cfg: Any, impl: str, ids: Any) -> Any:
    """The bf16 model of `cfg` with attention `impl`, the correctness pass's re-init, and the
    log-probability of each prompt token given the ones before it."""
    import torch
    import transformers

    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    # The engine worker's re-init, given the model where it expects a vLLM worker.
    reinit_weights(types.SimpleNamespace(get_model=lambda: model), WEIGHT_SEED, WEIGHT_STD)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def measure(cfg: Any, tokens: int, impls: tuple[str, str]) -> dict[str, Any]:
    import torch

    ids = torch.randint(3, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    seconds = {}
    lps = []
    for impl in impls:
        t = time.perf_counter()
        lps.append(prompt_logprobs(cfg, impl, ids))
        seconds[impl] = round(time.perf_counter() - t, 1)
    diff = (lps[0] - lps[1]).abs()
    bands = {
        f"{a}-{min(b, tokens)}": round(diff[a - 1 : min(b, tokens) - 1].mean().item(), 4)
        for a, b in BANDS
        if a < tokens
    }
    return {
        "mean_abs_dlogprob_by_position": bands,
        "max_abs_dlogprob": round(diff.max().item(), 4),
        "mean_abs_dlogprob": round(diff.mean().item(), 4),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a folder of models/ by name, or a folder")
    ap.add_argument("--layers", type=int, help="the first N layers only")
    ap.add_argument("--vocab", type=int, help="a smaller vocabulary")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--impls", nargs=2, default=("eager", "sdpa"), metavar="IMPL")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error(f"--tokens: expected at least 2, got {args.tokens}")
    import torch
    import transformers

    model = resolve_model(args.model)
    cfg = load_config(model, args.layers, args.vocab)
    result = {
        "benchmark": "rounding_sensitivity",
        "date": str(datetime.date.today()),
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model.name,
        "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size,
        "tokens": args.tokens,
        "impls": list(args.impls),
        "weights": {"std": WEIGHT_STD, "seed": WEIGHT_SEED, "norms": 1.0, "biases": 0.0},
        **measure(cfg, args.tokens, tuple(args.impls)),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = f"-{args.layers}l" if args.layers else ""
        path = args.out / f"rounding-sensitivity-cpu-{model.name}{tag}.json"
        path.write_text(json.dumps(result, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

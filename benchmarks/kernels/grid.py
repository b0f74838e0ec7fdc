"""The shape grid of `fuselane bench kernels`: model shapes and the cases timed per family.

Standard library only: the CLI builds its `--model` / `--family` choices from this module
without importing torch.

Every case is one (family, section, shape, size). Models that give a family the same shape
share its cases (Llama-3-8B and Mistral-7B write the same KV rows; both Llamas sample from one
vocabulary), so each shape is timed once and its rows name every model it stands for.

The full grid is meant to be run in several GPU calls (`--family`, `--model`, `--section`);
`estimate_s` says how long each case takes (docs/performance.md, "Benchmark commands", has the
suggested split) and `fuselane bench kernels --list` prints both without a GPU.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

FAMILIES: tuple[str, ...] = ("attention", "kv_cache", "sampling")
# Attention's bf16 sections come first, then the fp8 ones: a model's KV pool is made once per
# cache dtype (one pool is kept at a time, impls.Context.keep).
SECTIONS: dict[str, tuple[str, ...]] = {
    "attention": (
        "decode",
        "decode_ragged",
        "prefill",
        "mixed",
        "decode_fp8",
        "decode_ragged_fp8",
        "prefill_fp8",
    ),
    "kv_cache": ("kv_write", "kv_write_fp8", "rope_kv_write"),
    "sampling": ("sampling",),
}
ALL_SECTIONS: tuple[str, ...] = tuple(s for f in FAMILIES for s in SECTIONS[f])
# Decode sections, and those whose KV cache is fp8 e4m3 with per-tensor scales (the sections
# name the cache dtype, as kv_write / kv_write_fp8 do, so a case key is the same in both).
DECODE_SECTIONS = ("decode", "decode_fp8", "decode_ragged", "decode_ragged_fp8")
RAGGED_SECTIONS = ("decode_ragged", "decode_ragged_fp8")
FP8_SECTIONS = ("decode_fp8", "decode_ragged_fp8", "prefill_fp8", "kv_write_fp8")
PREFILL_SECTIONS = ("prefill", "prefill_fp8")
GRIDS: tuple[str, ...] = ("full", "quick", "smoke")
PAGE = 16  # KV-cache block size of every case (vLLM's default on GPUs)


@dataclass(frozen=True)
class ModelShape:
    """What the kernels see of a model: attention heads (per GPU), head size, vocabulary; and
    its layer count, which only sizes the grid (a whole model's KV cache per token)."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    vocab: int
    sliding_window: int | None = None
    softcap: float = 0.0
    note: str = ""
    num_layers: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer (on one GPU) for one token."""
        return self.num_layers * self.num_kv_heads * self.head_size * 2 * 2

    @property
    def heads(self) -> str:
        return f"Hq={self.num_q_heads} Hkv={self.num_kv_heads} D={self.head_size}"

    def describe(self) -> dict[str, object]:
        return {
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "vocab": self.vocab,
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
            "num_layers": self.num_layers,
            "note": self.note,
        }


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 8, 128, 128256, num_layers=32),
        ModelShape(
            "llama-3-70b-tp8", 8, 1, 128, 128256, num_layers=80,
            note="Llama-3-70B (64/8/128) as one GPU of tensor parallel 8 sees it",
        ),
        ModelShape(
            "qwen-2.5-7b", 28, 4, 128, 152064, num_layers=28, note="7 query heads per KV head"
        ),
        ModelShape(
            "mistral-7b", 32, 8, 128, 32768, sliding_window=4096, num_layers=32,
            note="v0.1's sliding window, v0.3's vocabulary",
        ),
        ModelShape(
            "gemma-2-9b", 16, 8, 256, 256000, softcap=50.0, num_layers=42,
            note="head size 256 as Gemma-3's; soft cap as Gemma-2's global layers",
        ),
    )
}  # fmt: skip
# The launch-rule sweeps' models: the grid's, and head size 64 (a shape the rules must answer
# for, as small models run it) without adding its rows to the grid. Llama-3.2-1B's config:
# 32 query heads, 8 KV heads, head_dim 64, 16 layers (meta-llama/Llama-3.2-1B, config.json).
SWEEP_MODELS: dict[str, ModelShape] = {
    **MODELS,
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 32, 8, 64, 128256, num_layers=16),
}
# The interpreter smoke run's only model: small enough for Triton's interpreter on a CPU.
SMOKE_MODEL = ModelShape("tiny", 4, 2, 64, 1000, note="plumbing check under the interpreter")

# Uniform decode batches: every B a server runs, each at the longest context whose KV cache
# (all layers, bf16) of the grid's largest model per token still fits KV_BUDGET_BYTES: what an
# 80 GB H100 holds beside the weights. Gemma-2-9B keeps 42 x 8 x 256 x 2 x 2 B = 336 KiB per
# token, so B x context <= ~124k tokens (B=1: 32768, B=64: 1536, B=256: 384). The benchmark
# itself allocates one layer's pool, sized by the grid's largest case (the ragged B=128
# log-uniform draw, ~400k tokens: 3.3 GB for Gemma, attention_cases.pool_pages).
KV_BUDGET_BYTES = 40 << 30
DECODE_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
MAX_DECODE_CONTEXT = 32768
PREFILL_LENS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)  # causal, one sequence


def decode_context(batch: int, budget_tokens: int) -> int:
    """The longest round context (2^k or 3 * 2^k tokens, at most MAX_DECODE_CONTEXT) for which
    `batch` sequences hold at most `budget_tokens` tokens."""
    limit = min(MAX_DECODE_CONTEXT, budget_tokens // batch)
    rounds = [c for k in range(8, 16) for c in (1 << k, 3 << (k - 1)) if c <= limit]
    if not rounds:
        raise ValueError(f"batch {batch}: fewer than 256 tokens per sequence fit the budget")
    return max(rounds)


def _budget_tokens() -> int:
    return KV_BUDGET_BYTES // max(m.kv_bytes_per_token for m in MODELS.values())


@dataclass(frozen=True)
class ContextDist:
    """Context lengths of a ragged decode batch, drawn per sequence from a fixed seed.

    kind "loguniform": exp(U(ln a, ln b)); "lognormal": median a, sigma b of ln(length).
    Lengths are rounded and clipped to [lo, hi]. Only `random.Random.random()` is used (the
    transforms are written here), so a draw is the same on every Python version.
    """

    kind: str
    a: float
    b: float
    lo: int
    hi: int
    name: str = ""  # prefix of the label, e.g. "chat"

    @property
    def label(self) -> str:
        prefix = f"{self.name}-" if self.name else ""
        return f"{prefix}{self.kind}({self.a:g},{self.b:g})"

    def seed(self, batch: int) -> int:
        """The draw's seed: fixed by the label and the batch size, so every model, dtype and
        peer of a run, and every run, sees the same lengths."""
        return zlib.crc32(f"{self.label} B={batch}".encode())

    def draw(self, batch: int) -> list[int]:
        rng = random.Random(self.seed(batch))
        out = []
        for _ in range(batch):
            if self.kind == "loguniform":
                x = math.exp(math.log(self.a) + rng.random() * math.log(self.b / self.a))
            elif self.kind == "lognormal":  # Box-Muller from two uniforms
                u1, u2 = 1.0 - rng.random(), rng.random()
                z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
                x = self.a * math.exp(self.b * z)
            else:
                raise ValueError(f"kind: expected loguniform or lognormal, got {self.kind!r}")
            out.append(min(self.hi, max(self.lo, round(x))))
        return out


# Ragged decode batches, at RAGGED_BATCHES sequences each:
# - log-uniform between 100 and 16,384 tokens: every decade of context equally likely (mean
#   ~3,200 tokens: B=128 holds ~400k tokens, past the uniform cases' budget: a stress mix);
# - a chat service: context = prompt + tokens generated so far, log-normal with median 1,024
#   and sigma 1 (two thirds between ~380 and ~2,800 tokens, 5% above ~5,300), clipped to
#   [32, 16384] (mean ~1,700 tokens: B=128 holds ~215k).
RAGGED_DISTS: dict[str, ContextDist] = {
    "loguniform": ContextDist("loguniform", 100, 16384, 100, 16384),
    "chat": ContextDist("lognormal", 1024, 1, 32, 16384, name="chat"),
}
RAGGED_BATCHES: tuple[int, ...] = (16, 48, 128)

# Sizes per section: decode (batch, context), ragged decode (batch, RAGGED_DISTS name), prefill
# (sequence length), mixed (prefill chunks, chunk length, decode rows, context of every row),
# KV writes (tokens), sampling (batch). A section missing from a grid has no case there: the
# quick and smoke grids keep the cases (keys) of the committed gate baselines.
_DECODE_FULL = [(b, decode_context(b, _budget_tokens())) for b in DECODE_BATCHES]
_RAGGED_FULL = [(b, name) for name in RAGGED_DISTS for b in RAGGED_BATCHES]
SIZES: dict[str, dict[str, list]] = {
    "full": {
        "decode": _DECODE_FULL,
        "decode_ragged": _RAGGED_FULL,
        "prefill": list(PREFILL_LENS),
        "mixed": [(4, 512, 60, 4096)],
        "decode_fp8": _DECODE_FULL,
        "decode_ragged_fp8": _RAGGED_FULL,
        "prefill_fp8": list(PREFILL_LENS),
        "kv_write": [1, 256, 4096, 32768],
        "kv_write_fp8": [1, 256, 4096, 32768],
        "rope_kv_write": [1, 1024, 8192],
        "sampling": [1, 32, 256],
    },
    "quick": {
        "decode": [(1, 8192), (64, 4096)],
        "prefill": [4096],
        "mixed": [(4, 512, 60, 4096)],
        "kv_write": [1, 4096],
        "kv_write_fp8": [4096],
        "rope_kv_write": [1024],
        "sampling": [1, 64],
    },
    "smoke": {
        "decode": [(2, 40)],
        "prefill": [48],
        "mixed": [(1, 24, 2, 40)],
        "prefill_fp8": [48],
        "kv_write": [5],
        "kv_write_fp8": [5],
        "rope_kv_write": [5],
        "sampling": [2],
    },
}


@dataclass(frozen=True)
class Case:
    """One timed problem; `key` is its `case` string in the results (unique per section)."""

    family: str
    section: str
    models: tuple[str, ...]
    shape: ModelShape
    size: tuple[int, ...]
    dist: ContextDist | None = None  # ragged decode: where the contexts are drawn from

    @property
    def params(self) -> dict[str, int]:
        return dict(zip(_PARAMS.get(self.section, ("tokens",)), self.size, strict=True))

    @property
    def contexts(self) -> list[int] | None:
        """Every sequence's context length (decode sections), else None."""
        p = self.params
        if self.section in RAGGED_SECTIONS:
            return self.dist.draw(p["batch"]) if self.dist is not None else None
        if self.section in DECODE_SECTIONS:
            return [p["context"]] * p["batch"]
        return None

    @property
    def label(self) -> str:
        p = self.params
        if self.section in RAGGED_SECTIONS:
            return f"B={p['batch']} ctx={self.dist.label if self.dist else '?'}"
        if self.section in DECODE_SECTIONS:
            return f"B={p['batch']} ctx={p['context']}"
        if self.section in PREFILL_SECTIONS:
            return f"S={p['seq_len']}"
        if self.section == "mixed":
            return (
                f"{p['chunks']}x{p['chunk_len']} prefill + {p['decodes']} decode, "
                f"ctx={p['context']}"
            )
        if self.section == "sampling":
            return f"B={p['batch']} V={self.shape.vocab}"
        return f"tokens={p['tokens']}"

    @property
    def model_label(self) -> str:
        return "/".join(self.models)

    @property
    def key(self) -> str:
        return f"{self.model_label} {self.label}"

    @property
    def seed(self) -> int:
        """A per-case seed, stable across runs and across the two passes of one run."""
        return zlib.crc32(f"{self.section} {self.key}".encode())


_PARAMS: dict[str, tuple[str, ...]] = {
    "decode": ("batch", "context"),
    "decode_fp8": ("batch", "context"),
    "decode_ragged": ("batch",),
    "decode_ragged_fp8": ("batch",),
    "prefill": ("seq_len",),
    "prefill_fp8": ("seq_len",),
    "mixed": ("chunks", "chunk_len", "decodes", "context"),
    "sampling": ("batch",),
}


def _shape_key(section: str, m: ModelShape) -> tuple:
    """What the kernels of a section see of a model: models with equal keys share cases."""
    if section in SECTIONS["attention"]:
        return (m.num_q_heads, m.num_kv_heads, m.head_size, m.sliding_window, m.softcap)
    if section == "rope_kv_write":
        return (m.num_q_heads, m.num_kv_heads, m.head_size)
    if section == "sampling":
        return (m.vocab,)
    return (m.num_kv_heads, m.head_size)


def build_grid(
    families: tuple[str, ...] = FAMILIES,
    models: tuple[str, ...] | None = None,
    grid: str = "full",
    sections: tuple[str, ...] | None = None,
) -> list[Case]:
    """The cases to run, model-major (every family of the first model first), so a time budget
    that stops the run early cuts whole models, not whole families. `sections` (default: all)
    keeps only those sections of the chosen families."""
    if grid not in GRIDS:
        raise ValueError(f"grid: expected one of {', '.join(GRIDS)}, got {grid!r}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"family {unknown[0]!r}: expected one of {', '.join(FAMILIES)}")
    bad_sections = [s for s in sections or () if s not in ALL_SECTIONS]
    if bad_sections:
        raise ValueError(f"section {bad_sections[0]!r}: expected one of {', '.join(ALL_SECTIONS)}")
    if grid == "smoke":
        shapes = [SMOKE_MODEL]
    else:
        names = list(MODELS) if not models else list(dict.fromkeys(models))
        bad = [n for n in names if n not in MODELS]
        if bad:
            raise ValueError(f"model {bad[0]!r}: expected one of {', '.join(MODELS)}")
        shapes = [MODELS[n] for n in names]
    cases = []
    for i, m in enumerate(shapes):
        for family in FAMILIES:
            if family not in families:
                continue
            for section in SECTIONS[family]:
                if sections and section not in sections:
                    continue
                key = _shape_key(section, m)
                if any(_shape_key(section, prev) == key for prev in shapes[:i]):
                    continue  # timed with the first model of this shape
                sharing = tuple(s.name for s in shapes if _shape_key(section, s) == key)
                for size in SIZES[grid].get(section, ()):
                    if section in RAGGED_SECTIONS:
                        batch, dist = size
                        cases.append(
                            Case(family, section, sharing, m, (batch,), RAGGED_DISTS[dist])
                        )
                        continue
                    size = size if isinstance(size, tuple) else (size,)
                    cases.append(Case(family, section, sharing, m, size))
    return cases


# ----------------------------------------------------------------------------------------------
# How long a case takes on the GPU (for splitting the full grid into calls)
# ----------------------------------------------------------------------------------------------

# Seconds per implementation row (inputs, reference, first call, graph capture, ~0.3 s of
# replays): the H100 --quick run with peers took 251 s for 121 rows and 27 FlashInfer rows
# left out while their builds ran (benchmarks/results/kernels-h100-80gb-hbm3-2026-11-22.json),
# ~2.1 s a row; the peer-less gate baseline took 71 s for 44 rows (baseline-kernels-h100.json),
# ~1.6 s a fuselane row, KV writes ~0.8 s (first calls 0.1-0.3 s against 1-5 s for attention
# and sampling). RUN_START_S: torch and Triton imports, the measured ceilings.
ROW_S = {"attention": 2.1, "kv_cache": 0.8, "sampling": 2.1}
RUN_START_S = 20.0
# Rows per case with every peer importing: fuselane, vLLM's Triton kernel and FlashInfer or
# torch's, as the family modules add them; KV writes add torch's index_copy_ (bf16), prefill
# SDPA flash and cuDNN where SDPA can express the model (no soft cap, no window it outgrows).
_EXTRA_ROWS = {"kv_write": 1}
# vLLM's unified kernel runs causal prefill ~6x slower than fuselane (29 ms at S=16384 for
# Llama-3-8B on an H200, attention-h200-2026-11-26.json), ~12 calls per row: seconds per
# (1k tokens)^2, scaled by the model's FLOPs per token pair.
_LONG_PREFILL_S_PER_KTOK2 = 12 * 29e-3 / 16.384**2


def estimate_s(case: Case) -> float:
    """Estimated GPU seconds of one case with every peer (without RUN_START_S or FlashInfer's
    one-time builds, which run beside the timed cases)."""
    rows = 3 + _EXTRA_ROWS.get(case.section, 0)
    if case.section not in PREFILL_SECTIONS:
        return rows * ROW_S[case.family]
    m, n = case.shape, case.params["seq_len"]
    sdpa = m.softcap == 0 and (m.sliding_window is None or n <= m.sliding_window)
    if case.section == "prefill" and sdpa:  # SDPA reads a dense bf16 copy: not an fp8 peer
        rows += 2
    flops = m.head_size / 128 * m.num_q_heads / 32  # per (query, key) pair, against Llama-3-8B's
    return rows * ROW_S["attention"] + _LONG_PREFILL_S_PER_KTOK2 * (n / 1024) ** 2 * flops

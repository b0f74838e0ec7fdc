"""The shape grid of `fuselane bench kernels`: model shapes and the cases timed per family.

Standard library only: the CLI builds its `--model` / `--family` choices from this module
without importing torch.

Every case is one (family, section, shape, size). Models that give a family the same shape
share its cases (Llama-3-8B and Mistral-7B write the same KV rows; both Llamas sample from one
vocabulary), so each shape is timed once and its rows name every model it stands for.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

FAMILIES: tuple[str, ...] = ("attention", "kv_cache", "sampling")
SECTIONS: dict[str, tuple[str, ...]] = {
    "attention": ("decode", "prefill", "mixed"),
    "kv_cache": ("kv_write", "kv_write_fp8", "rope_kv_write"),
    "sampling": ("sampling",),
}
GRIDS: tuple[str, ...] = ("full", "quick", "smoke")
PAGE = 16  # KV-cache block size of every case (vLLM's default on GPUs)


@dataclass(frozen=True)
class ModelShape:
    """What the kernels see of a model: attention heads (per GPU), head size, vocabulary."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    vocab: int
    sliding_window: int | None = None
    softcap: float = 0.0
    note: str = ""

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
            "note": self.note,
        }


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 8, 128, 128256),
        ModelShape(
            "llama-3-70b-tp8", 8, 1, 128, 128256,
            note="Llama-3-70B (64/8/128) as one GPU of tensor parallel 8 sees it",
        ),
        ModelShape("qwen-2.5-7b", 28, 4, 128, 152064, note="7 query heads per KV head"),
        ModelShape(
            "mistral-7b", 32, 8, 128, 32768, sliding_window=4096,
            note="v0.1's sliding window, v0.3's vocabulary",
        ),
        ModelShape(
            "gemma-2-9b", 16, 8, 256, 256000, softcap=50.0,
            note="head size 256 as Gemma-3's; soft cap as Gemma-2's global layers",
        ),
    )
}  # fmt: skip
# The interpreter smoke run's only model: small enough for Triton's interpreter on a CPU.
SMOKE_MODEL = ModelShape("tiny", 4, 2, 64, 1000, note="plumbing check under the interpreter")

# Sizes per section: decode (batch, context), prefill (sequence length), mixed (prefill
# chunks, chunk length, decode rows, context of every row), KV writes (tokens), sampling (batch).
SIZES: dict[str, dict[str, list]] = {
    "full": {
        "decode": [(1, 8192), (16, 4096), (64, 4096), (256, 2048)],
        "prefill": [2048, 8192],
        "mixed": [(4, 512, 60, 4096)],
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

    @property
    def params(self) -> dict[str, int]:
        names = {
            "decode": ("batch", "context"),
            "prefill": ("seq_len",),
            "mixed": ("chunks", "chunk_len", "decodes", "context"),
            "sampling": ("batch",),
        }.get(self.section, ("tokens",))
        return dict(zip(names, self.size, strict=True))

    @property
    def label(self) -> str:
        p = self.params
        if self.section == "decode":
            return f"B={p['batch']} ctx={p['context']}"
        if self.section == "prefill":
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


def _shape_key(section: str, m: ModelShape) -> tuple:
    """What the kernels of a section see of a model: models with equal keys share cases."""
    if section in ("decode", "prefill", "mixed"):
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
) -> list[Case]:
    """The cases to run, model-major (every family of the first model first), so a time budget
    that stops the run early cuts whole models, not whole families."""
    if grid not in GRIDS:
        raise ValueError(f"grid: expected one of {', '.join(GRIDS)}, got {grid!r}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"family {unknown[0]!r}: expected one of {', '.join(FAMILIES)}")
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
                key = _shape_key(section, m)
                if any(_shape_key(section, prev) == key for prev in shapes[:i]):
                    continue  # timed with the first model of this shape
                sharing = tuple(s.name for s in shapes if _shape_key(section, s) == key)
                for size in SIZES[grid][section]:
                    size = size if isinstance(size, tuple) else (size,)
                    cases.append(Case(family, section, sharing, m, size))
    return cases

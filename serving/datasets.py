"""Prompts for `fuselane bench serve`: synthetic lengths and dataset files.

Two sources, both giving `loadgen.RequestSpec`s (prompt text, planned prompt tokens, max tokens):

- synthetic: prompt and output lengths drawn per request from a `LengthSpec` (`128` fixed, or
  `64:256` uniform over the inclusive range). Prompt text is cut from a fixed English-like word
  stream to the asked token count with a tokenizer — a local `tokenizer.json` or the server's
  own `/tokenize` and `/detokenize` routes (vLLM's), so no model files are needed on the client.
  Requests start at distinct offsets of the stream, so prompts share no prefix and the
  server's prefix cache does not flatter either arm.
- a dataset file, in one of the two layouts `vllm bench serve` reads:
  - JSONL, one object a line: `{"prompt": "...", "output_tokens": 128}` (`output_tokens`
    optional; vLLM's "custom" dataset);
  - ShareGPT JSON: a list of `{"conversations": [{"from": "human", "value": "..."},
    {"from": "gpt", "value": "..."}, ...]}`; the first turn is the prompt, the second turn's
    token count the output length, and entries are filtered as vLLM does (prompt or output under
    4 tokens, prompt over 1024, prompt + output over 2048 are skipped).

Prompt lengths follow vLLM's convention: tokens of the text without special tokens (the server
adds BOS and, for chat, its template). The server's own count comes back in the usage field and
is what the metrics use.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fuselane.serving.loadgen import RequestSpec

if TYPE_CHECKING:
    import httpx

# vLLM's `is_valid_sequence` defaults, applied to ShareGPT entries as `vllm bench serve` does.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

# Re-encoding decoded text can merge or split tokens at the cut; a few rounds of trimming and
# extending converge for BPE tokenizers (vLLM's random dataset does the same).
_FIT_ROUNDS = 6

_WORDS = (
    "the a one every each some request token cache kernel block page server engine model "
    "batch queue layer head value key prompt answer output input user system reply story "
    "writes reads moves serves checks fuses samples measures returns updates streams "
    "computes stores keeps sends waits runs starts ends grows fills drops takes gives "
    "quickly again slowly first next last long short small large new old fast warm cold "
    "in on for with from into over after before under between without about across "
    "and or but so then while because if when where how why what which who this that"
).split()


class LengthSpec:
    """A token length: fixed (`"128"`) or uniform over an inclusive range (`"64:256"`)."""

    def __init__(self, lo: int, hi: int | None = None) -> None:
        hi = lo if hi is None else hi
        if lo < 1 or hi < lo:
            raise ValueError(f"length range must satisfy 1 <= LO <= HI, got {lo}:{hi}")
        self.lo, self.hi = lo, hi

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        parts = text.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (1, 2):
            raise ValueError(f"expected N or LO:HI (positive integers), got {text!r}")
        return cls(*nums)

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class DatasetEntry:
    prompt: str
    output_tokens: int | None = None  # JSONL's optional field
    completion: str | None = None  # ShareGPT's second turn, whose length is the output length


class Tokenizer(Protocol):
    """What prompt fitting needs; async so that a server's /tokenize route can serve it."""

    async def encode(self, text: str) -> list[int]: ...  # without special tokens

    async def decode(self, ids: Sequence[int]) -> str: ...


class LocalTokenizer:
    """A Hugging Face `tokenizer.json` (file or model directory), read with `tokenizers`."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:
            raise RuntimeError("a local tokenizer needs `pip install tokenizers`") from exc

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        self._tok = HFTokenizer.from_file(str(file))

    async def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    async def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class ServerTokenizer:
    """vLLM's `/tokenize` and `/detokenize` routes of one endpoint."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._client, self._url, self._model = client, base_url.rstrip("/"), model
        self._headers = dict(headers or {})

    async def _post(self, route: str, body: dict) -> dict:
        resp = await self._client.post(
            self._url + route, json={"model": self._model, **body}, headers=self._headers
        )
        resp.raise_for_status()
        return resp.json()

    async def encode(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"prompt": text, "add_special_tokens": False}))[
            "tokens"
        ]

    async def decode(self, ids: Sequence[int]) -> str:
        return (await self._post("/detokenize", {"tokens": list(ids)}))["prompt"]

    async def available(self) -> bool:
        import httpx

        try:
            await self.encode("probe")
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return True


def word_stream(num_words: int, seed: int) -> str:
    """English-like filler text, the same for a given seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


async def fit_prompt(
    tok: Tokenizer, pool: Sequence[int], offset: int, length: int
) -> tuple[str, int]:
    """Text cut from `pool` (token ids of the word stream) at `offset` that encodes to `length`
    tokens, or as close as the tokenizer allows; returns (text, its token count)."""
    ids = [pool[(offset + i) % len(pool)] for i in range(length)]
    text = await tok.decode(ids)
    n = len(await tok.encode(text))
    for _ in range(_FIT_ROUNDS):
        if n == length:
            break
        if n > length:
            ids = ids[: max(1, len(ids) - (n - length))]
        else:
            start = offset + len(ids)
            ids = ids + [pool[(start + i) % len(pool)] for i in range(length - n)]
        text = await tok.decode(ids)
        n = len(await tok.encode(text))
    return text, n


async def synthetic_requests(
    num: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    tokenizer: Tokenizer | None,
    seed: int = 0,
    parallel: int = 8,
) -> list[RequestSpec]:
    """`num` requests with lengths drawn from the specs (same seed, same requests).

    Without a tokenizer the prompt is `input_len` words and its planned length is unknown (None):
    the server's count in the usage field still gives the true input tokens.
    """
    rng = random.Random(seed)
    lens = [(input_len.sample(rng), output_len.sample(rng)) for _ in range(num)]
    if tokenizer is None:
        words = word_stream(max(p for p, _ in lens) * 4, seed).split()
        specs = []
        for p, o in lens:
            off = rng.randrange(len(words) - p)
            specs.append(RequestSpec(" ".join(words[off : off + p]), o, None))
        return specs
    # Over a token a word: the pool holds a few times the longest prompt and enough distinct
    # start offsets for every request.
    pool = await tokenizer.encode(word_stream(max(max(p for p, _ in lens) * 3, num) + 64, seed))
    offsets = rng.sample(range(len(pool)), num)
    sem = asyncio.Semaphore(parallel)

    async def one(i: int) -> RequestSpec:
        async with sem:
            text, n = await fit_prompt(tokenizer, pool, offsets[i], lens[i][0])
        return RequestSpec(text, lens[i][1], n)

    return list(await asyncio.gather(*(one(i) for i in range(num))))


def load_dataset(path: str | Path) -> list[DatasetEntry]:
    """Read a JSONL prompt file or a ShareGPT JSON file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {p} does not exist")
    if p.suffix == ".jsonl":
        entries = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{p}:{n}: each line needs a string "prompt" field')
            out = obj.get("output_tokens")
            if out is not None and (not isinstance(out, int) or out < 1):
                raise ValueError(f'{p}:{n}: "output_tokens" must be a positive integer')
            entries.append(DatasetEntry(obj["prompt"], out))
    elif p.suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{p}: a ShareGPT file is a JSON list of conversations")
        entries = [
            DatasetEntry(e["conversations"][0]["value"], None, e["conversations"][1]["value"])
            for e in data
            if isinstance(e, dict) and len(e.get("conversations") or []) >= 2
        ]
    else:
        raise ValueError(f"{p}: dataset files are .jsonl (prompts) or .json (ShareGPT layout)")
    if not entries:
        raise ValueError(f"{p}: no usable entries")
    return entries


async def dataset_requests(
    entries: Sequence[DatasetEntry],
    num: int,
    output_len: LengthSpec | None,
    tokenizer: Tokenizer | None,
    seed: int = 0,
) -> list[RequestSpec]:
    """`num` requests from the entries: shuffled with `seed`, cycled when there are fewer.

    The output length is `output_len` when given, else the entry's own (`output_tokens`, or the
    ShareGPT completion's token count, which needs a tokenizer).
    """
    rng = random.Random(seed)
    order = list(entries)
    rng.shuffle(order)
    picked: list[RequestSpec] = []
    for e in order:
        plen = len(await tokenizer.encode(e.prompt)) if tokenizer else None
        if output_len is not None:
            olen = output_len.sample(rng)
        elif e.output_tokens is not None:
            olen = e.output_tokens
        elif e.completion is not None and tokenizer is not None:
            olen = len(await tokenizer.encode(e.completion))
        else:
            raise ValueError(
                "the dataset gives no output length for its entries: pass --output-len, or a "
                "tokenizer (--tokenizer, or a server with /tokenize) to count completion tokens"
            )
        if e.completion is not None and plen is not None:
            if (
                plen < SHAREGPT_MIN_LEN
                or (output_len is None and olen < SHAREGPT_MIN_LEN)
                or plen > SHAREGPT_MAX_PROMPT_LEN
                or plen + olen > SHAREGPT_MAX_TOTAL_LEN
            ):
                continue
        picked.append(RequestSpec(e.prompt, olen, plen))
        if len(picked) == num:
            break
    if not picked:
        raise ValueError("every dataset entry was filtered out (too short or too long)")
    return [picked[i % len(picked)] for i in range(num)]

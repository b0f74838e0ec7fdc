"""Comparing the two arms' answers to the same greedy request.

A mirrored request is re-sent to both arms as a non-streaming greedy copy that asks for token
ids and the chosen tokens' logprobs (`shadow_copy`). Greedy decoding is deterministic, so any
difference comes from the kernels. Once the token sequences diverge, later positions are
conditioned on different prefixes and say nothing more, so:

- agreement = (common prefix length) / (longer sequence's length), 1.0 when both are empty;
- logprob divergence = max |logprob_stock - logprob_custom| over the common prefix (the same
  token at the same position, so the numbers are directly comparable).

A pair that cannot be compared (an arm failed, timed out, answered an error) is counted as a
failure with its reason (`failure_reason`), never silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Comparison:
    agreement: float  # in [0, 1]
    exact: bool
    common_prefix: int
    max_logprob_diff: float  # 0.0 when there is no common prefix
    len_stock: int
    len_custom: int


class PairResult(NamedTuple):
    """One mirrored pair, as an ingress replica reports it to the monitor."""

    agreement: float | None  # None: the pair failed, `error` says why
    exact: bool | None
    max_logprob_diff: float
    epoch: int  # the operator epoch the pair started under
    error: str | None = None


def failure_reason(e: BaseException) -> str:
    """`Type: message`, never empty: a TimeoutError or CancelledError has an empty str, and a
    log line or status that reads "failed: " tells nobody anything."""
    return f"{type(e).__name__}: {str(e).strip() or repr(e)}"


def shadow_copy(body: Mapping[str, Any], chat: bool, max_tokens_cap: int) -> dict[str, Any]:
    """The greedy, non-streaming copy of a request body that both arms answer."""
    copy = dict(body)
    for k in ("stream", "stream_options", "n", "best_of", "seed", "top_p", "top_k", "min_p"):
        copy.pop(k, None)
    copy.update(temperature=0.0, stream=False, n=1, return_token_ids=True)
    requested = copy.get("max_completion_tokens") if chat else None
    requested = requested or copy.get("max_tokens") or max_tokens_cap
    copy.pop("max_completion_tokens", None)
    copy["max_tokens"] = min(int(requested), max_tokens_cap)
    if chat:
        copy.update(logprobs=True, top_logprobs=0)
    else:
        copy["logprobs"] = 0
    return copy


def extract(response: Mapping[str, Any], chat: bool) -> tuple[list[int], list[float]]:
    """Token ids and chosen-token logprobs of choice 0 of a (dumped) response."""
    choice = response["choices"][0]
    ids = list(choice.get("token_ids") or [])
    lp = choice.get("logprobs") or {}
    if chat:
        logprobs = [float(c["logprob"]) for c in (lp.get("content") or [])]
    else:
        logprobs = [float(x) for x in (lp.get("token_logprobs") or []) if x is not None]
    return ids, logprobs


def compare(
    ids_stock: Sequence[int],
    lp_stock: Sequence[float],
    ids_custom: Sequence[int],
    lp_custom: Sequence[float],
) -> Comparison:
    n = 0
    for a, b in zip(ids_stock, ids_custom, strict=False):
        if a != b:
            break
        n += 1
    longest = max(len(ids_stock), len(ids_custom))
    diffs = [abs(a - b) for a, b in zip(lp_stock[:n], lp_custom[:n], strict=False)]
    return Comparison(
        agreement=1.0 if longest == 0 else n / longest,
        exact=list(ids_stock) == list(ids_custom),
        common_prefix=n,
        max_logprob_diff=max(diffs, default=0.0),
        len_stock=len(ids_stock),
        len_custom=len(ids_custom),
    )


async def run_pair(
    answer: Callable[[str, dict[str, Any]], Awaitable[Mapping[str, Any]]],
    body: Mapping[str, Any],
    chat: bool,
    max_tokens_cap: int,
    epoch: int,
) -> PairResult:
    """Mirror one request: `answer(arm, copy)` returns an arm's dumped response to the greedy
    copy. Any failure becomes a PairResult with its reason; cancellation (a rollback stops
    the mirroring) is not a failure and propagates."""
    try:
        copy = shadow_copy(body, chat, max_tokens_cap)
        stock, custom = await asyncio.gather(answer("stock", copy), answer("custom", copy))
        c = compare(*extract(stock, chat), *extract(custom, chat))
    except Exception as e:  # noqa: BLE001 - a failed comparison is counted, never raised
        return PairResult(None, None, 0.0, epoch, failure_reason(e))
    return PairResult(c.agreement, c.exact, c.max_logprob_diff, epoch)

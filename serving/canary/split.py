"""Which arm a request goes to: a pin, a sticky key, or a weighted coin.

Sticky keys hash to a fixed point in [0, 1) (SHA-256, not Python's per-process salted `hash`),
so every ingress replica, and every restart, sends a key to the same arm. A key goes to `custom`
when its point is below the weight: raising the weight only moves keys from stock to custom,
never back, so a session changes arm at most once during a ramp-up.

The pin header is unauthenticated: anyone who can reach the ingress can send it. So it selects
`stock` always, `custom` only where the config allows pinning to custom
(`routing.allow_pin_custom`, for benchmarks on a closed network), and never a rolled-back
custom arm: a rollback takes custom away from every client, pinned or not.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Arm = Literal["stock", "custom"]
ARMS: tuple[Arm, Arm] = ("stock", "custom")


def key_point(key: str) -> float:
    """A stable point in [0, 1) for a sticky key."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class Decision:
    arm: Arm
    how: Literal["pinned", "sticky", "weighted"]
    key: str | None = None


def sticky_key(
    headers: Mapping[str, str], body: Mapping[str, Any], session_header: str, use_user: bool
) -> str | None:
    """The request's sticky key: the session header, else the OpenAI `user` field."""
    value = headers.get(session_header.lower())
    if value:
        return f"s:{value}"
    user = body.get("user") if use_user else None
    if isinstance(user, str) and user:
        return f"u:{user}"
    return None


class PinRefused(Exception):
    """A well-formed pin that the canary does not honour; `status` is the HTTP answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _check_pin(pin: str, allow_pin_custom: bool, rolled_back: bool) -> Arm:
    pin = pin.strip().lower()
    if pin not in ARMS:
        raise ValueError(f"unknown arm {pin!r}; the arms are {', '.join(ARMS)}")
    if pin == "custom" and not allow_pin_custom:
        raise PinRefused(
            "pinning requests to the custom arm is not enabled on this canary "
            "(routing.allow_pin_custom)",
            403,
        )
    if pin == "custom" and rolled_back:
        raise PinRefused(
            "the custom arm is rolled back: no request reaches it until an operator sets "
            "its weight again",
            503,
        )
    return pin  # type: ignore[return-value]


def choose_arm(
    weight: float,
    *,
    pin: str | None = None,
    key: str | None = None,
    rng: random.Random | None = None,
    allow_pin_custom: bool = False,
    rolled_back: bool = False,
) -> Decision:
    """Route one request. `pin` (an arm name) wins; otherwise a sticky `key` decides by its
    point; otherwise a coin with P(custom) = weight. Raises ValueError for an unknown pin and
    PinRefused for a pin to custom that is not allowed (`allow_pin_custom`) or that would
    reach a rolled-back arm (`rolled_back`)."""
    if pin:
        return Decision(_check_pin(pin, allow_pin_custom, rolled_back), "pinned")
    if key is not None:
        return Decision("custom" if key_point(key) < weight else "stock", "sticky", key)
    u = (rng or random).random()
    return Decision("custom" if u < weight else "stock", "weighted")

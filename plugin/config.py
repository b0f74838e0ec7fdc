"""`FUSELANE_KERNELS`: which fuselane kernel families replace vLLM's own in this process.

The variable is a comma list of `attention`, `kv_cache`, `sampling`, or `all` / `none`; unset or
empty means `none`. Case and surrounding spaces are ignored. Anything else is an error whose
message lists the valid values: `register()` raises it, which stops vLLM's start-up in the
process that loads the plugin (vLLM calls general plugins without catching their errors).

This module imports nothing from vLLM, torch or triton, so it is cheap for the entry point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_VAR = "FUSELANE_KERNELS"
# TEST ONLY (plugin/faults.py): families whose outputs are corrupted after the kernel.
FAULT_INJECT_ENV_VAR = "FUSELANE_FAULT_INJECT"

ATTENTION = "attention"
KV_CACHE = "kv_cache"
SAMPLING = "sampling"
FAMILIES = (ATTENTION, KV_CACHE, SAMPLING)
ALL = "all"
NONE = "none"
VALID_VALUES = (*FAMILIES, ALL, NONE)


class FuselaneConfigError(ValueError):
    """An invalid `FUSELANE_KERNELS` value."""


@dataclass(frozen=True)
class KernelSelection:
    """The parsed variable.

    `families` is what the operator asked for. `explicit` is False when the variable was
    unset or empty: the backend uses that to decide its KV write when it is chosen with
    `--attention-backend CUSTOM` (see `backend_writes_kv_cache`).
    """

    families: frozenset[str]
    explicit: bool
    raw: str = ""

    @property
    def attention(self) -> bool:
        return ATTENTION in self.families

    @property
    def kv_cache(self) -> bool:
        return KV_CACHE in self.families

    @property
    def sampling(self) -> bool:
        return SAMPLING in self.families

    @property
    def backend_writes_kv_cache(self) -> bool:
        """Whether the fuselane attention backend writes the KV cache with fuselane's kernel.

        Yes unless the operator set the variable and left `kv_cache` out (e.g.
        `FUSELANE_KERNELS=attention`): then the backend keeps vLLM's TRITON_ATTN write, so the
        attention kernel can be canaried alone. `--attention-backend CUSTOM` with the variable
        unset gets the whole fuselane backend.
        """
        return self.kv_cache or not self.explicit

    def describe(self) -> str:
        """`attention, kv_cache` in canonical order, or `none`."""
        names = [f for f in FAMILIES if f in self.families]
        return ", ".join(names) if names else NONE


def parse_kernels(value: str | None) -> KernelSelection:
    """Parse a `FUSELANE_KERNELS` value; raise FuselaneConfigError naming the valid values."""
    raw = "" if value is None else value
    items = [item.strip().lower() for item in raw.split(",")]
    items = [item for item in items if item]
    if not items:
        return KernelSelection(frozenset(), explicit=False, raw=raw)
    bad = [item for item in items if item not in VALID_VALUES]
    if bad:
        raise FuselaneConfigError(
            f"{ENV_VAR}={raw!r}: unknown value(s) {bad}; expected a comma list of "
            f"{', '.join(FAMILIES)}, or {ALL} / {NONE} (valid values: {', '.join(VALID_VALUES)})"
        )
    if (ALL in items or NONE in items) and len(items) > 1:
        raise FuselaneConfigError(
            f"{ENV_VAR}={raw!r}: {ALL!r} and {NONE!r} stand alone; expected a comma list of "
            f"{', '.join(FAMILIES)}, or {ALL} / {NONE} (valid values: {', '.join(VALID_VALUES)})"
        )
    if items == [ALL]:
        return KernelSelection(frozenset(FAMILIES), explicit=True, raw=raw)
    if items == [NONE]:
        return KernelSelection(frozenset(), explicit=True, raw=raw)
    return KernelSelection(frozenset(items), explicit=True, raw=raw)


def kernels_from_env(environ: dict[str, str] | None = None) -> KernelSelection:
    """The selection in `environ` (default: this process's environment), read afresh."""
    env = os.environ if environ is None else environ
    return parse_kernels(env.get(ENV_VAR))


def parse_fault_inject(value: str | None) -> frozenset[str]:
    """Parse a `FUSELANE_FAULT_INJECT` value (TEST ONLY: see plugin/faults.py): a comma list of
    the families, or `all` / `none`; unset or empty means none. Anything else raises
    FuselaneConfigError naming the valid values."""
    items = [item.strip().lower() for item in (value or "").split(",") if item.strip()]
    bad = [item for item in items if item not in VALID_VALUES]
    if bad:
        raise FuselaneConfigError(
            f"{FAULT_INJECT_ENV_VAR}={value!r}: unknown value(s) {bad}; expected a comma list "
            f"of {', '.join(FAMILIES)}, or {ALL} / {NONE}"
        )
    if ALL in items:
        return frozenset(FAMILIES)
    return frozenset(item for item in items if item != NONE)


def faults_from_env(environ: dict[str, str] | None = None) -> frozenset[str]:
    """The families FUSELANE_FAULT_INJECT names in `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    return parse_fault_inject(env.get(FAULT_INJECT_ENV_VAR))

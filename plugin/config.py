"""`FUSELANE_KERNELS`: which fuselane kernel families replace vLLM's own in this process.

The variable is a comma list of `attention`, `kv_cache`, `sampling`, or `all` / `none`; unset or
empty means `none`. Case and surrounding spaces are ignored. Anything else is an error whose
message lists the valid values: `register()` raises it, which stops vLLM's start-up in the
process that loads the plugin (vLLM calls general plugins without catching their errors).

Also here, for the same reason (refuse at start-up what would fail later): the test switch
`FUSELANE_FAULT_INJECT` (read as `FUSELANE_KERNELS` is), the check that the kernels can run
under Triton's interpreter where they need it (`interpreter_problem`), and the host-name check
that `FUSELANE_TELEMETRY_PORT` and the canary's `http.host` share (`host_problem`).

This module imports nothing from vLLM, torch or triton, so it is cheap for the entry point (and
for the canary's config check, which validates the arms' variables with these functions).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Mapping
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
    """An invalid fuselane variable, or a process the selected kernels cannot run in.

    `variable` names the variable at fault, so that a caller validating another process's
    environment (the canary's arms) can say where it was set.
    """

    def __init__(self, message: str, variable: str = ENV_VAR) -> None:
        super().__init__(message)
        self.variable = variable


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


def _families(variable: str, value: str | None) -> frozenset[str] | None:
    """A comma list of the families, or `all` / `none`, as one variable takes it (None: unset
    or empty). `FUSELANE_KERNELS` and `FUSELANE_FAULT_INJECT` share this reading, so a value
    that one refuses the other refuses too."""
    raw = "" if value is None else value
    items = [item.strip().lower() for item in raw.split(",")]
    items = [item for item in items if item]
    if not items:
        return None
    expected = (
        f"expected a comma list of {', '.join(FAMILIES)}, or {ALL} / {NONE} "
        f"(valid values: {', '.join(VALID_VALUES)})"
    )
    bad = [item for item in items if item not in VALID_VALUES]
    if bad:
        raise FuselaneConfigError(
            f"{variable}={raw!r}: unknown value(s) {bad}; {expected}", variable
        )
    if (ALL in items or NONE in items) and len(items) > 1:
        raise FuselaneConfigError(
            f"{variable}={raw!r}: {ALL!r} and {NONE!r} stand alone; {expected}", variable
        )
    if items == [ALL]:
        return frozenset(FAMILIES)
    if items == [NONE]:
        return frozenset()
    return frozenset(items)


def parse_kernels(value: str | None) -> KernelSelection:
    """Parse a `FUSELANE_KERNELS` value; raise FuselaneConfigError naming the valid values."""
    families = _families(ENV_VAR, value)
    raw = "" if value is None else value
    if families is None:
        return KernelSelection(frozenset(), explicit=False, raw=raw)
    return KernelSelection(families, explicit=True, raw=raw)


def kernels_from_env(environ: Mapping[str, str] | None = None) -> KernelSelection:
    """The selection in `environ` (default: this process's environment), read afresh."""
    env = os.environ if environ is None else environ
    return parse_kernels(env.get(ENV_VAR))


def parse_fault_inject(value: str | None) -> frozenset[str]:
    """Parse a `FUSELANE_FAULT_INJECT` value (TEST ONLY: see plugin/faults.py): read as
    `FUSELANE_KERNELS` is; unset or empty means none. Anything else raises
    FuselaneConfigError naming the valid values."""
    return _families(FAULT_INJECT_ENV_VAR, value) or frozenset()


def faults_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The families FUSELANE_FAULT_INJECT names in `environ` (default: this process's)."""
    env = os.environ if environ is None else environ
    return parse_fault_inject(env.get(FAULT_INJECT_ENV_VAR))


# ---------------------------------------------------------------------------------------------
# Triton's interpreter (no GPU)
# ---------------------------------------------------------------------------------------------

CHECK_INDICES_ENV_VAR = "FUSELANE_CHECK_INDICES"


def _parse_switch(value: str | None, env_var: str, *, unset: bool, expected: str) -> bool:
    """A 0/1 variable: "1" True, "0" False, unset or empty `unset`; anything else refused."""
    raw = (value or "").strip()
    if raw in ("0", "1"):
        return raw == "1"
    if raw == "":
        return unset
    raise FuselaneConfigError(f"{env_var}={value!r}: expected {expected}", env_var)


def parse_check_indices(value: str | None) -> bool:
    """FUSELANE_CHECK_INDICES: "1" checks every kernel call's device-side indices before its
    launch (block tables, sequence lengths, query offsets, KV slots, positions, sampling state
    slots: one host sync per call, a debugging and canary switch); "0" or unset: off."""
    return _parse_switch(value, CHECK_INDICES_ENV_VAR, unset=False, expected="1 (on) or 0 (off)")


def check_indices_from_env(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_check_indices(env.get(CHECK_INDICES_ENV_VAR))


HOPPER_ENV_VAR = "FUSELANE_HOPPER_KERNELS"


def parse_hopper_kernels(value: str | None) -> bool:
    """FUSELANE_HOPPER_KERNELS: "0" keeps the Hopper (sm_90) warp-specialized attention kernels
    out of this process, so that fuselane's Triton attention kernels run every batch (the
    operator's switch for triage: the rest of fuselane stays as selected); "1" or unset: on
    where they apply."""
    return _parse_switch(
        value,
        HOPPER_ENV_VAR,
        unset=True,
        expected="0 (Triton kernels only) or 1 (the Hopper kernels where they apply, the default)",
    )


def hopper_kernels_from_env(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_hopper_kernels(env.get(HOPPER_ENV_VAR))


INTERPRET_ENV_VAR = "TRITON_INTERPRET"
INTERPRET_FIX = f"export {INTERPRET_ENV_VAR}=1 before starting vLLM"


def _jit_bound_without_interpreter() -> bool:
    """Whether Triton was imported in this process without its interpreter.

    Triton chooses compiled or interpreted per `@triton.jit` function, when the function is
    defined (`knobs.runtime.interpret`, read from the environment at that moment). Its own
    library (`tl.sum`, `tl.cumsum`, ... in `triton.language.standard`) is defined when Triton is
    imported; an interpreted kernel that calls one of those compiled-mode functions fails with
    "Cannot call @triton.jit'd outside of the scope of a kernel". Triton not imported yet: the
    interpreter can still be chosen.
    """
    standard = sys.modules.get("triton.language.standard")
    jit = sys.modules.get("triton.runtime.jit")
    jit_function = getattr(jit, "JITFunction", None)
    if standard is None or jit_function is None:
        return False
    return any(isinstance(v, jit_function) for v in vars(standard).values())


def interpreter_problem(
    selection: KernelSelection,
    *,
    gpu: bool,
    engine_in_process: bool,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """Why the selected kernels cannot run in this process, with the fix; None when they can.

    Call after `fuselane.kernels.use_interpreter_without_gpu()`. `gpu`: a CUDA device is
    visible. `engine_in_process`: vLLM's engine runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Every vLLM process has imported Triton before plugins
    load, so the API-server process of a multiprocess engine always has compiled-mode Triton:
    that is harmless, its engine process starts afresh and inherits TRITON_INTERPRET=1 from
    `register()`. An in-process engine keeps the Triton it has, and its first fused call dies.
    """
    if not selection.families:
        return None
    env = os.environ if environ is None else environ
    value = env.get(INTERPRET_ENV_VAR, "")
    interpreted = value not in ("", "0")
    what = f"{ENV_VAR}={selection.raw!r} selects fuselane's kernels ({selection.describe()})"
    if not gpu and not interpreted:
        return (
            f"{what}, no GPU is visible, so they need Triton's interpreter, but "
            f"{INTERPRET_ENV_VAR}={value!r} turns it off: {INTERPRET_FIX} (or {ENV_VAR}=none)"
        )
    if interpreted and engine_in_process and _jit_bound_without_interpreter():
        return (
            f"{what} under Triton's interpreter, but Triton was imported in this process "
            f"before the plugin could choose the interpreter, and vLLM's engine runs in this "
            f"process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the first request would fail in the "
            f"kernels. {INTERPRET_FIX} (or {ENV_VAR}=none)"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Host names (FUSELANE_TELEMETRY_PORT, the canary's http.host)
# ---------------------------------------------------------------------------------------------

# One RFC 1123 label: letters, digits and inner hyphens, 1 to 63 characters.
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: str) -> str | None:
    """Why `host` is neither an IP address nor a host name, or None. Syntax only: nothing is
    resolved (the name may exist only where the process runs)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return (
            f"{host!r} is neither an IP address nor a host name (letters, digits and '-', "
            f"in labels joined by '.')"
        )
    if all(label.isdigit() for label in labels):
        return f"{host!r} is not a valid IP address"
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""`fuselane check`: run each kernel family on one batch and compare it with its reference.

Each family contributes a function that returns result rows; a row is one case with its error
against the reference and the tolerance it is held to. Sizes follow Llama-3-8B (8 KV heads of
128) with batch sizes small enough for Triton's interpreter when no GPU is present.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch


@dataclass
class CheckRow:
    family: str
    case: str
    max_abs_err: float
    tolerance: float
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tolerance


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _timed(fn: Callable[..., object], *args: object) -> float:
    """Wall time of one call of fn(*args), device work included."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; NaN anywhere counts as an infinite error."""
    d = (a.float() - b.float()).abs()
    if torch.isnan(d).any():
        return float("inf")
    return float(d.max()) if d.numel() else 0.0


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """Largest |a - b| / max(|b|, floor); NaN anywhere counts as an infinite error."""
    d = (a.float() - b.float()).abs() / b.float().abs().clamp_min(floor)
    if torch.isnan(d).any():
        return float("inf")
    return float(d.max()) if d.numel() else 0.0


def _cache_err(got: torch.Tensor, want: torch.Tensor, *, relative: bool = False) -> float:
    """Error over written slots; infinite if the NaN poison differs (a slot written or missed)."""
    g, w = got.float(), want.float()
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return float("inf")
    written = ~torch.isnan(w)
    return (_rel_err if relative else _max_err)(g[written], w[written])


def check_kv_cache(seed: int) -> list[CheckRow]:
    from fuselane.kernels import kv_cache as kv

    dev = _device()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens, hkv, hq, d, block, nblocks = 48, 8, 32, 128, 16, 64
    rows: list[CheckRow] = []

    def fresh_cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # One tensor holding K and V, split into strided views as vLLM's backends do.
        kvc = torch.full((nblocks, 2, block, hkv, d), float("nan"), device=dev)
        kvc = kvc.to(dtype) if dtype != torch.float8_e4m3fn else kvc.to(torch.float8_e4m3fn)
        return kvc[:, 0], kvc[:, 1]

    slots = torch.randperm(nblocks * block, generator=gen)[:tokens].to(dev)
    slots[::7] = -1  # padding tokens: nothing may be written for them
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dev, torch.bfloat16)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)

    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        scale = torch.tensor([0.05], device=dev) if cache_dtype == torch.float8_e4m3fn else None
        got_k, got_v = fresh_cache(cache_dtype)
        want_k, want_v = fresh_cache(cache_dtype)
        secs = _timed(kv.kv_cache_update, k, v, got_k, got_v, slots, scale, scale)
        kv.kv_cache_update_reference(k, v, want_k, want_v, slots, scale, scale)
        err = max(_cache_err(got_k, want_k), _cache_err(got_v, want_v))
        name = "bf16" if cache_dtype == torch.bfloat16 else "fp8-e4m3 (quantize on write)"
        # Kernel and reference round the same fp32 value once: the stored values are identical.
        rows.append(CheckRow("kv_cache", f"write {tokens} tokens, {name}", err, 0.0, secs))

    # Llama's rotary table: cos | sin of position * 10000^(-2i/d), as vLLM builds it.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dev)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(dev)
    for neox in (True, False):
        got_k, got_v = fresh_cache(torch.bfloat16)
        want_k, want_v = fresh_cache(torch.bfloat16)
        q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
        secs = _timed(
            kv.rope_kv_cache_update, positions, q1, k1, v, cos_sin, neox, got_k, got_v, slots
        )
        kv.rope_kv_cache_update_reference(
            positions, q2, k2, v, cos_sin, neox, want_k, want_v, slots
        )
        err = max(
            _rel_err(q1, q2),
            _rel_err(k1, k2),
            _cache_err(got_k, want_k, relative=True),
            _cache_err(got_v, want_v),
        )
        # Rotated bf16 q/k: rounding an fp32 result to bf16 (8 significant bits) errs by at most
        # 2^-8 relative; Triton's interpreter truncates instead (2^-7). |ref| near 0 gets an
        # absolute floor of 1e-2.
        rows.append(
            CheckRow("kv_cache", f"rope ({'neox' if neox else 'gpt-j'}) + write", err, 2**-7, secs)
        )
    return rows


FAMILIES: dict[str, tuple[str, Callable[[int], list[CheckRow]]]] = {
    "kv_cache": ("fuselane.kernels.kv_cache", check_kv_cache),
}


def run_selfcheck(*, families: list[str] | None, seed: int, out: TextIO) -> int:
    """Run the checks, print a table to `out`; return 0 if all pass, 1 otherwise."""
    unknown = sorted(set(families or []) - set(FAMILIES))
    if unknown:
        out.write(f"unknown kernel family {unknown[0]!r}; valid: {', '.join(FAMILIES)}\n")
        return 2
    dev = _device()
    mode = (
        "GPU " + torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter)"
    )
    out.write(f"fuselane check on {mode}, seed {seed}\n\n")
    rows: list[CheckRow] = []
    for name in families or list(FAMILIES):
        module, fn = FAMILIES[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            out.write(f"{name}: not installed ({exc})\n")
            return 1
        rows.extend(fn(seed))
    header = f"{'family':<10} {'case':<46} {'max |err|':>10} {'tolerance':>10} {'time':>9}  result"
    out.write(header + "\n" + "-" * len(header) + "\n")
    for r in rows:
        out.write(
            f"{r.family:<10} {r.case:<46} {r.max_abs_err:>10.3g} {r.tolerance:>10.3g} "
            f"{r.seconds * 1e3:>7.1f}ms  {'PASS' if r.ok else 'FAIL'} {r.detail}\n"
        )
    failed = [r for r in rows if not r.ok]
    out.write(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed\n")
    return 1 if failed else 0

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


def _timed(fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    """Wall time of one call of fn(*args, **kwargs), device work included."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
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


def check_attention(seed: int) -> list[CheckRow]:
    from fuselane.kernels import attention as attn

    dev = _device()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, d, block = 32, 8, 128, 16
    rows: list[CheckRow] = []
    # (name, query lengths, kv lengths): decode rows, a verify row and a prefill chunk after a
    # cached prefix, as vLLM's chunked-prefill scheduler mixes them.
    cases = (
        ("decode, 4 sequences", [1, 1, 1, 1], [1, 37, 300, 1000]),
        ("mixed decode + verify + prefill chunk", [1, 4, 48, 1], [700, 90, 160, 17]),
    )
    for name, q_lens, seq_lens in cases:
        pages = [-(-s // block) for s in seq_lens]
        num_blocks = sum(pages) + 1
        kv = torch.randn(num_blocks, block, hkv, 2 * d, generator=gen).to(dev, torch.bfloat16)
        key_cache, value_cache = kv[..., :d], kv[..., d:]
        perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is never used
        table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
        start = 0
        for i, n in enumerate(pages):
            table[i, :n] = perm[start : start + n].to(torch.int32)
            start += n
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dev, torch.bfloat16)
        args = dict(
            cu_seqlens_q=cu.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            scale=d**-0.5,
        )
        out = torch.full_like(q, float("nan"))
        want = torch.full_like(q, float("nan"))
        ws = attn.AttentionWorkspace.allocate(q.shape[0], hq, d, dev, max_splits=4)
        secs = _timed(attn.paged_attention, q, key_cache, value_cache, out, **args, workspace=ws)
        attn.paged_attention_reference(q, key_cache, value_cache, want, **args)
        # bf16 output of an fp32-accumulated softmax(QK)V with |out| < 2: one bf16 ulp.
        rows.append(CheckRow("attention", name, _max_err(out, want), 1.6e-2, secs))
    return rows


def check_sampling(seed: int) -> list[CheckRow]:
    from fuselane.kernels import sampling as smp

    dev = _device()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    batch, vocab = 8, 4099  # vocabulary not a power of two
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dev)
    rows: list[CheckRow] = []
    greedy = smp.SamplingParamsTensors(temperature=torch.zeros(batch, device=dev))
    # torch's rounding: the draws then equal the reference's exactly on a GPU too (Triton's
    # rounding, the serving default, differs by at most 2 ulp: tests/kernels/test_sampling.py)
    ws = smp.SamplingWorkspace.allocate(batch, vocab, dev, arith="torch")
    secs = _timed(lambda: smp.fused_sample(logits, greedy, workspace=ws))
    got = smp.fused_sample(logits, greedy, workspace=ws).token_ids
    wrong = int((got != logits.argmax(dim=-1)).sum())
    rows.append(CheckRow("sampling", "greedy = argmax", float(wrong), 0.0, secs, "rows differ"))
    params = smp.SamplingParamsTensors(
        temperature=torch.full((batch,), 0.7, device=dev),
        top_k=torch.full((batch,), 50, dtype=torch.int32, device=dev),
        top_p=torch.full((batch,), 0.9, device=dev),
        seeds=torch.arange(batch, dtype=torch.int64, device=dev) + seed,
        has_seed=torch.ones(batch, dtype=torch.bool, device=dev),
        seed_offsets=torch.zeros(batch, dtype=torch.int64, device=dev),
    )
    secs = _timed(lambda: smp.fused_sample(logits, params, workspace=ws))
    got = smp.fused_sample(logits, params, workspace=ws).token_ids
    want = smp.sample_reference(logits, params).token_ids
    wrong = int((got != want).sum())
    rows.append(
        CheckRow(
            "sampling",
            "seeded T=0.7 k=50 p=0.9 = reference draw",
            float(wrong),
            0.0,
            secs,
            "rows differ",
        )
    )
    return rows


FAMILIES: dict[str, tuple[str, Callable[[int], list[CheckRow]]]] = {
    "kv_cache": ("fuselane.kernels.kv_cache", check_kv_cache),
    "attention": ("fuselane.kernels.attention", check_attention),
    "sampling": ("fuselane.kernels.sampling", check_sampling),
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
    from .stack_report import stack_lines

    out.write("\n".join(stack_lines()) + "\n\n")
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
            f"{r.seconds * 1e3:>7.1f}ms  {'PASS' if r.ok else 'FAIL ' + r.detail}\n"
        )
    failed = [r for r in rows if not r.ok]
    out.write(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed\n")
    return 1 if failed else 0

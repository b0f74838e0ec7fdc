"""The attention script's workload (bench_attention): the goal cases, their inputs, the fp32
reference and the checks against it.

Llama-3-8B attention (Hq=32, Hkv=8, D=128, page 16, bf16, scale 1/sqrt(D)) over one random KV
pool; a `Problem` is one call's inputs as fuselane / vLLM (block table) and FlashInfer (indptr
form) see them; `Expected` holds the reference's output of a timed case, which every
implementation's output is compared with. `run_checks` is the script's broad GPU check over
other shapes and options. `fuselane bench kernels` builds its attention cases with the same
helpers (attention_cases.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fuselane.benchmarks.kernels import family_script
from fuselane.kernels import attention as attn

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
SCALE = 1.0 / math.sqrt(D)
DECODE_CASES = [(1, 32768), (16, 4096), (64, 4096), (128, 8192), (256, 2048)]
PREFILL_LENS = (4096, 8192, 16384)
MIXED_DECODES, MIXED_CHUNKS, MIXED_CHUNK, MIXED_SEQ_LEN = 60, 4, 512, 4096
# KV pool: enough pages for the largest decode case (128 x 8192 tokens = 4.3 GB in bf16)
POOL_PAGES = max(b * ctx for b, ctx in DECODE_CASES) // PAGE + 256
# Split-KV workspace of the benchmark: room for 64 splits of 256 query rows (sweeps included:
# B=256 with 2 splits), 268 MB
WS_ROWS, WS_SPLITS = 256, 64
# Check tolerances against the fp32 reference (the GPU rounds to nearest; see the tests' table)
TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}
PREFILL_CHECK_ROWS = 256  # prefill cases check their first and last rows (the reference is O(S^2))
# Where the script's tensors live: read at call time (`attention_workload.DEVICE` in the other
# attention modules), so that `impls.bench_scripts_on` can point it elsewhere (the interpreter
# smoke run of `fuselane bench kernels` builds its inputs on the CPU).
DEVICE = "cuda"


def decode_case(batch: int, ctx: int) -> str:
    return f"B={batch} ctx={ctx} Hq={HQ} Hkv={HKV} D={D} page={PAGE}"


def prefill_case(seq: int) -> str:
    return f"S={seq} Hq={HQ} Hkv={HKV} D={D} causal paged"


MIXED_CASE = (
    f"{MIXED_CHUNKS}x{MIXED_CHUNK} prefill chunks + {MIXED_DECODES} decodes, ctx {MIXED_SEQ_LEN}, "
    f"Hq={HQ} Hkv={HKV} D={D}"
)


# ----------------------------------------------------------------------------------------------
# Inputs, the reference, and the check of an output against it
# ----------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One call's inputs, as fuselane/vLLM (block table) and FlashInfer (indptr form) see them."""

    q: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [pages, 2, page, Hkv, D]
    cu: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    q_lens: list[int]
    lens: list[int]
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [pages used] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.q_lens)

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv[:, 1]

    def args(self, **options) -> dict:
        """Keyword arguments of paged_attention / paged_attention_reference (minus out)."""
        return dict(
            q=self.q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            cu_seqlens_q=self.cu,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            max_query_len=max(self.q_lens),
            # as vLLM's backend passes it: a batch of prefill chunks has no decode launch
            min_query_len=min((n for n in self.q_lens if n > 0), default=0),
            max_seq_len=max(self.lens),
            scale=options.pop("scale", SCALE),
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            **options,
        )

    def bundles(self, **options) -> tuple[attn.PagedBatch, attn.AttentionOptions]:
        """The batch and options as vLLM's backend passes them (built once per step / layer);
        options: as `args` takes them (scale, sliding_window, softcap, sinks)."""
        a = self.args(**options)
        batch = attn.PagedBatch(
            a["cu_seqlens_q"], a["seq_lens"], a["block_table"], a["max_query_len"],
            a["min_query_len"], a["max_seq_len"],
        )  # fmt: skip
        return batch, attn.AttentionOptions(
            a["scale"], a.get("sliding_window"), a.get("softcap", 0.0), a.get("sinks"),
            a["k_scale"], a["v_scale"],
        )  # fmt: skip


def make_pool(num_pages: int, page: int, heads: int, head_size: int, dtype) -> torch.Tensor:
    """Random KV pages [num_pages, 2, page, heads, head_size] (fp8: e4m3 codes of 2*randn)."""
    if dtype == FP8:
        return (torch.randn(num_pages, 2, page, heads, head_size, device=DEVICE) * 2).to(FP8)
    return torch.randn(num_pages, 2, page, heads, head_size, device=DEVICE, dtype=dtype)


def make_problem(
    q_lens: list[int],
    lens: list[int],
    gen: torch.Generator,
    *,
    kv: torch.Tensor | None = None,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
    page: int = PAGE,
    dtype=DTYPE,
    kv_dtype=None,
) -> Problem:
    """A batch over `kv` (or a fresh pool just large enough), pages a random permutation."""
    pages = [math.ceil(n / page) for n in lens]
    if kv is None:
        kv = make_pool(sum(pages) + 8, page, hkv, d, kv_dtype or dtype)
    page, hkv, d = kv.shape[2], kv.shape[3], kv.shape[4]
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(pages)].to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start : start + n]
        start += n
    i32 = dict(dtype=torch.int32, device=DEVICE)
    indptr = [0, *torch.tensor(pages).cumsum(0).tolist()]
    last = [n - (p - 1) * page for n, p in zip(lens, pages, strict=True)]
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, dtype)
    scales = {}
    if kv.dtype == FP8:
        scales = dict(
            k_scale=torch.tensor([0.37], device=DEVICE), v_scale=torch.tensor([0.61], device=DEVICE)
        )
    return Problem(
        q=q,
        kv=kv,
        cu=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], **i32),
        seq_lens=torch.tensor(lens, **i32),
        block_table=table.to(DEVICE),
        q_lens=list(q_lens),
        lens=list(lens),
        kv_indptr=torch.tensor(indptr, **i32),
        kv_indices=perm.to(DEVICE),
        kv_last_page_len=torch.tensor(last, **i32),
        **scales,
    )


def sub_problem(p: Problem, rows: slice, seq_len: int) -> Problem:
    """One sequence of `p` cut to query rows `rows` ending at key `seq_len` (for checks)."""
    q_len = rows.stop - rows.start
    return dataclasses.replace(
        p,
        q=p.q[rows],
        cu=torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        block_table=p.block_table[:1],
        q_lens=[q_len],
        lens=[seq_len],
    )


def reference(p: Problem, **options) -> torch.Tensor:
    """The fp32 reference's output on `p` (rows past the batch stay NaN)."""
    ref = torch.full_like(p.q, float("nan"))
    return attn.paged_attention_reference(out=ref, **p.args(**options))


def compare(out: torch.Tensor, ref: torch.Tensor, rows: int) -> tuple[bool, str]:
    """out[:rows] against ref[:rows]: (within the dtype's tolerance and NaN-free, description)."""
    got, want = out[:rows].float(), ref[:rows].float()
    atol, rtol = TOL[out.dtype]
    diff = (got - want).abs().nan_to_num(float("inf"))
    ok = bool((diff <= atol + rtol * want.abs()).all())
    return ok, f"max abs err {float(diff.max()):.3g} (atol {atol}, rtol {rtol}), rows {rows}"


def max_error(out: torch.Tensor, p: Problem, **options) -> tuple[bool, str]:
    return compare(out, reference(p, **options), p.num_rows)


class Expected:
    """Reference outputs of one timed case, computed once and compared with every impl.

    Prefill cases (O(S^2) reference) check their first and last PREFILL_CHECK_ROWS rows: the
    first rows are a prefill of that length, the last ones a chunk ending at key S.
    """

    def __init__(self, p: Problem, prefill: bool = False, **options) -> None:
        """options: the case's options of `reference` (scale, sliding_window, softcap, ...)."""
        self.prefill = prefill
        if prefill:
            s = p.lens[0]
            self.rows = r = min(PREFILL_CHECK_ROWS, s)
            self.head = reference(sub_problem(p, slice(0, r), r), **options)
            self.tail = reference(sub_problem(p, slice(s - r, s), s), **options)
            self.seq = s
        else:
            self.full = reference(p, **options)
            self.rows = p.num_rows

    def check(self, out: torch.Tensor) -> tuple[bool, str]:
        if not self.prefill:
            return compare(out, self.full, self.rows)
        r = self.rows
        ok1, d1 = compare(out[:r], self.head, r)
        ok2, d2 = compare(out[self.seq - r : self.seq], self.tail, r)
        return ok1 and ok2, f"first rows: {d1}; last rows: {d2}"


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def checked_point(fn: Callable[[], object], out: torch.Tensor, expected: Expected) -> dict:
    """A sweep point: `fn` run once and `out` checked against `expected`, then, if it matched,
    `fn` timed (CUDA-graph replay median). Returns the point's ok, detail and, when timed,
    timing and us (µs per call); a point that cannot run is recorded with its error as the
    detail."""
    from fuselane.benchmarks.kernels.suite import time_call  # the suite imports the families

    try:
        fn()
        torch.cuda.synchronize()
        ok, detail = expected.check(out)
    except Exception as e:  # noqa: BLE001 - a point that cannot run is recorded
        ok, detail = False, repr(e)[:300]
    point: dict = {"ok": ok, "detail": detail}
    if ok:
        ms, point["timing"] = time_call(fn, interpret=False)
        point["us"] = round(ms * 1e3, 2)
    return point


def decode_bytes(p: Problem, window: int | None = None) -> int:
    """Bytes a decode call over `p` moves: the K and V rows it reads (the last `window` keys of
    each sequence at most), q and out."""
    keys = sum(n if window is None else min(n, window) for n in p.lens)
    hkv, d = p.kv.shape[3], p.kv.shape[4]
    return keys * hkv * d * 2 * p.kv.element_size() + 2 * p.q.numel() * p.q.element_size()


def plan_shape(p: Problem, workspace: attn.AttentionWorkspace) -> dict:
    """The shape arguments `attn.plan_launch` and `attn.decode_ws_config` take for `p` on its
    device."""
    q, kc = p.q, p.key_cache
    return dict(
        num_seqs=len(p.lens), num_q_heads=q.shape[1], num_kv_heads=kc.shape[2],
        head_size=q.shape[2], sms=attn.sm_count(q.device), workspace=workspace,
        kv_bytes=kc.element_size(), max_smem=attn.smem_per_block(q.device),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The GPU check against the reference (the script's step 2)
# ----------------------------------------------------------------------------------------------

CHECKS = [
    # (q_lens, seq_lens, Hq, Hkv, D, page, q dtype, kv dtype, options)
    ([1, 1, 1], [1, 1000, 5000], 32, 8, 128, 16, DTYPE, None, {}),
    ([1] * 5, [17, 64, 65, 300, 2500], 8, 1, 64, 32, torch.float16, None, {}),
    ([4, 4, 4], [4, 90, 1200], 28, 4, 128, 16, DTYPE, None, {}),
    ([1, 3, 300, 1, 77], [900, 50, 1500, 1, 77], 32, 8, 128, 16, DTYPE, None, {}),
    ([1024], [1024], 32, 8, 128, 16, DTYPE, None, {}),
    ([1, 5, 200, 1], [3000, 40, 700, 9], 16, 4, 128, 16, DTYPE, FP8,
     dict(sliding_window=256, softcap=30.0, sinks="randn")),
    ([1, 2, 130, 1], [400, 70, 1000, 2], 8, 2, 256, 64, DTYPE, None, {}),
    ([1, 1, 90, 6], [2000, 33, 600, 100], 12, 4, 80, 16, torch.float16, None,
     dict(sliding_window=100)),
    ([1] * 4, [1, 31, 700, 4000], 32, 32, 96, 32, torch.float16, None, {}),
    ([1, 64, 8], [128, 64, 300], 4, 4, 64, 64, DTYPE, FP8, dict(sinks="randn")),
]  # fmt: skip


def check_case(case: tuple, gen: torch.Generator) -> tuple[bool, str]:
    """fuselane on one of CHECKS against the reference: (within tolerance, description)."""
    q_lens, lens, hq, hkv, d, page, dtype, kv_dtype, options = case
    p = make_problem(
        q_lens, lens, gen, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, kv_dtype=kv_dtype
    )
    opts = dict(options)
    if opts.get("sinks") == "randn":
        opts["sinks"] = torch.randn(hq, generator=gen).to(DEVICE) * 2
    ws = attn.AttentionWorkspace.allocate(
        WS_ROWS, hq, d, torch.device(DEVICE), max_splits=WS_SPLITS
    )
    out = nan_like(p.q)
    attn.paged_attention(out=out, workspace=ws, **p.args(**opts))
    torch.cuda.synchronize()
    return max_error(out, p, **opts)


def run_checks(note: Callable[[str], None]) -> bool:
    """fuselane against the reference over CHECKS: a PASS / FAIL line each (failures noted);
    True if every one passed."""
    gen = torch.Generator().manual_seed(1234)
    all_ok = True
    for case in CHECKS:
        q_lens, lens, hq, hkv, d, page, dtype, kv_dtype, options = case
        name = (
            f"q_lens={q_lens} seq_lens={lens} Hq={hq} Hkv={hkv} D={d} page={page} "
            f"{str(dtype)[6:]} kv={str(kv_dtype or dtype)[6:]} {sorted(options)}"
        )
        if not family_script.check_line(note, name, functools.partial(check_case, case, gen)):
            all_ok = False
    return all_ok

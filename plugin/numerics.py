"""Numerical checks of kernel calls against the torch references, off the hot path.

On a sampled fraction of calls (`FUSELANE_TELEMETRY_CHECK_RATE`) the instrumented call keeps
a small copy of what the kernel read and wrote, and a worker thread recomputes the result with
the kernel family's torch reference (`fuselane.kernels.*_reference`, the functions that define
the kernels' semantics) and compares:

- attention: one sequence of the batch per check (rotating through the batch), at most
  `MAX_ROWS` of its last query rows, with the KV pages of its block-table row gathered up to
  the step's `max_seq_len`; output vs `paged_attention_reference` in fp32 with the per-dtype
  tolerances of the kernel tests.
- kv_cache: up to `MAX_ROWS` rows spread over the batch: the cache rows at their slots vs the
  input rows (bit-exact; fp8 vs `quantize_e4m3_reference`, also bit-exact by design).
- rope_kv_cache: the same rows' q and k before (kept before the launch: the kernel rotates in
  place) and after vs `rotary_reference`, and the cache rows vs the rotated key.
- sampling: one row per check: the kept-token set of `process_logits_reference` (its size vs
  the kernel's `kept_count`, allowing one token or 1% at the boundary), the chosen token (in
  the kept set; the argmax for greedy rows) and its log-probability when the kernel returned
  one (vs the reference of the requested `logprobs_mode`).

What a check records (telemetry turns it into metrics): pass/fail, max absolute error, relative
error (max |a - e| / max |e|), NaN and inf elements where the reference is finite, and elements
outside tolerance.

Copies, not references: the snapshot is taken on the launching stream right after the kernel
(gathers and clones, no host sync), so later steps cannot change it. On a GPU it is copied to
pinned host memory with non-blocking copies and an event; the worker polls the event under the
CUDA-graph capture guard and computes on the CPU, so nothing it does can invalidate a capture
or wait on the step. Calls made during a CUDA-graph capture are never checked: a graph replays
its launches without Python, so no per-replay copy can be taken; checks come from eager calls
(on GPUs: prefill and mixed batches, decode batches beyond the captured sizes, and every call
under --enforce-eager).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

# Rows (query rows, token rows) kept per check: enough to catch a wrong kernel, small enough to
# copy at any batch size.
MAX_ROWS = 32
# A check whose snapshot would exceed this (attention pages of very long sequences) is skipped
# and counted as dropped.
MAX_SNAPSHOT_BYTES = 64 << 20
# Checks waiting for the worker; beyond this new ones are dropped (and counted), never queued.
MAX_PENDING = 16

# (atol, rtol) per dtype against the fp32 references: the kernel tests' tables
# (tests/kernels/test_attention.py, tests/allclose.py).
ATTENTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
    torch.float32: (1e-5, 1e-5),
}
ROTARY_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# Chosen-token log-probabilities: fp32 math on both sides.
LOGPROB_TOLERANCE = (1e-3, 1e-3)
FP8 = torch.float8_e4m3fn


class SnapshotTooLarge(Exception):
    """The call is too big to copy for a check (counted as a dropped check)."""


@dataclass
class Outcome:
    """One check's result."""

    passed: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    nan: int = 0
    inf: int = 0
    mismatched: int = 0
    detail: str = ""

    def merge(self, other: Outcome) -> Outcome:
        return Outcome(
            passed=self.passed and other.passed,
            max_abs=max(self.max_abs, other.max_abs),
            max_rel=max(self.max_rel, other.max_rel),
            nan=self.nan + other.nan,
            inf=self.inf + other.inf,
            mismatched=self.mismatched + other.mismatched,
            detail="; ".join(d for d in (self.detail, other.detail) if d),
        )


def compare(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str
) -> Outcome:
    """Elementwise |a - e| <= atol + rtol |e|; where e is not finite, a must equal it."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return Outcome(False, math.inf, math.inf, 0, 0, max(a.numel(), 1), f"{what}: shape")
    e_fin = torch.isfinite(e)
    a_fin = torch.isfinite(a)
    nan = int((torch.isnan(a) & e_fin).sum())
    inf = int((torch.isinf(a) & e_fin).sum())
    both = e_fin & a_fin
    diff = torch.where(both, (a - e).abs(), 0.0)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(torch.where(e_fin, e.abs(), 0.0).max()) if e.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    out_of_tol = int((both & (diff > atol + rtol * e.abs())).sum())
    same_nonfinite = (a == e) | (torch.isnan(a) & torch.isnan(e))
    nonfinite_wrong = int((~e_fin & ~same_nonfinite).sum())
    mismatched = out_of_tol + nan + inf + nonfinite_wrong
    detail = ""
    if mismatched:
        detail = (
            f"{what}: {mismatched} of {a.numel()} elements off (max abs err {max_abs:.3g}, "
            f"atol {atol}, rtol {rtol}, {nan} NaN, {inf} inf)"
        )
    return Outcome(mismatched == 0, max_abs, max_rel, nan, inf, mismatched, detail)


# ---------------------------------------------------------------------------------------------
# Snapshots: what one check keeps, and the check itself
# ---------------------------------------------------------------------------------------------


class Snapshot:
    """Tensors copied at the call (device or host) and the check to run on their host copy."""

    kernel = ""

    def __init__(self, tensors: dict[str, torch.Tensor], **info: Any) -> None:
        self.info = info
        self._event: Any = None
        self._pinned: dict[str, torch.Tensor] | None = None
        if any(t.is_cuda for t in tensors.values()):
            # Non-blocking copies to pinned memory, ordered after the kernel on its stream.
            pinned = {}
            for name, t in tensors.items():
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                dst.copy_(t, non_blocking=True)
                pinned[name] = dst
            self._pinned = pinned
            self._event = torch.cuda.Event()
            self._event.record()
            self.tensors: dict[str, torch.Tensor] = {}
        else:
            self.tensors = tensors

    def ready(self, guard: Callable[[], AbstractContextManager[bool]]) -> bool:
        """Whether the host copy is complete (then `tensors` holds it)."""
        if self._event is None:
            return True
        with guard() as ok:
            if not ok or not self._event.query():
                return False
            # Own pageable copies; the pinned buffers go back to torch's pinned pool here,
            # under the guard (its bookkeeping makes CUDA calls).
            self.tensors = {k: v.clone() for k, v in self._pinned.items()}
            self._pinned = None
            self._event = None
        return True

    def check(self) -> Outcome | None:
        raise NotImplementedError


def _tensor_bytes(t: torch.Tensor, rows: int | None = None) -> int:
    per_row = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
    return per_row * (t.shape[0] if rows is None else rows)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a paged cache `[num_blocks, block_size, H, D]` at `slots` (bytes for fp8)."""
    view = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    block_size = cache.shape[1]
    safe = slots.long().clamp(0, cache.shape[0] * block_size - 1)
    return view[safe // block_size, safe % block_size]


def _spread(n: int, device: torch.device) -> torch.Tensor:
    """Up to MAX_ROWS row indices spread over [0, n), built on the device (no host copy)."""
    r = min(n, MAX_ROWS)
    return torch.arange(r, device=device) * (n // r)


class _Rotating:
    """Picks which sequence / row of the batch the next check looks at."""

    def __init__(self) -> None:
        self._turn = 0

    def next(self, n: int) -> int:
        self._turn += 1
        return (self._turn - 1) % n


# --- attention -------------------------------------------------------------------------------


class AttentionSnapshot(Snapshot):
    kernel = "attention"

    def check(self) -> Outcome | None:
        from fuselane.kernels.attention import paged_attention_reference

        t, info = self.tensors, self.info
        cu0, cu1, seq_len = (int(v) for v in t["meta"].tolist())
        rows = info["rows"]
        r = min(rows, cu1 - cu0)
        k, v = t["k"], t["v"]
        if info["fp8"]:
            k, v = k.view(FP8), v.view(FP8)
        num_pages, block_size = k.shape[0], k.shape[1]
        if r <= 0 or seq_len <= 0 or -(-seq_len // block_size) > num_pages:
            return None  # nothing of this sequence in the step, or pages beyond the bound
        q = t["q"][rows - r :]
        out = t["out"][rows - r :]
        ref = torch.zeros(q.shape, dtype=torch.float32)
        paged_attention_reference(
            q,
            k,
            v,
            ref,
            torch.tensor([0, r], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32),
            torch.arange(num_pages, dtype=torch.int32)[None],
            max_query_len=r,
            max_seq_len=seq_len,
            scale=info["scale"],
            sliding_window=info["sliding_window"],
            softcap=info["softcap"],
            sinks=t.get("sinks"),
            k_scale=t.get("k_scale"),
            v_scale=t.get("v_scale"),
        )
        atol, rtol = ATTENTION_TOLERANCES.get(q.dtype, (2.5e-2, 2.5e-2))
        return compare(out, ref, atol, rtol, "attention output")


class AttentionCheck:
    """Snapshots of `fuselane.kernels.attention.paged_attention` calls."""

    before = None

    def __init__(self) -> None:
        self._pick = _Rotating()

    def after(
        self,
        pre: Any,
        result: Any,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        max_query_len: int,
        max_seq_len: int,
        scale: float,
        min_query_len: int = 0,  # a launch choice of the kernel; the check needs none
        sliding_window: int | None = None,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        workspace: Any = None,
    ) -> Snapshot | None:
        num_seqs, num_rows = seq_lens.shape[0], q.shape[0]
        if num_seqs == 0 or num_rows == 0:
            return None
        b = self._pick.next(num_seqs)
        rows = max(1, min(int(max_query_len), MAX_ROWS, num_rows))
        block_size = key_cache.shape[1]
        pages = min(block_table.shape[1], -(-int(max_seq_len) // block_size))
        nbytes = 2 * pages * _tensor_bytes(key_cache, 1) + 2 * _tensor_bytes(q, rows)
        if nbytes > MAX_SNAPSHOT_BYTES:
            raise SnapshotTooLarge(f"attention: {nbytes} bytes")
        dev = q.device
        # The last `rows` query rows of sequence b (rows of its neighbour when it has fewer:
        # the check drops those, knowing the real length from `meta`).
        end = cu_seqlens_q[b + 1].long()
        row_idx = (end - rows + torch.arange(rows, device=dev)).clamp(0, num_rows - 1)
        table = block_table[b, :pages].long().clamp(0, key_cache.shape[0] - 1)
        fp8 = key_cache.dtype == FP8
        kc = key_cache.view(torch.uint8) if fp8 else key_cache
        vc = value_cache.view(torch.uint8) if fp8 else value_cache
        tensors = {
            "q": q.index_select(0, row_idx),
            "out": out.index_select(0, row_idx),
            "k": kc.index_select(0, table),
            "v": vc.index_select(0, table),
            "meta": torch.stack(
                [cu_seqlens_q[b].long(), cu_seqlens_q[b + 1].long(), seq_lens[b].long()]
            ),
        }
        if sinks is not None:
            tensors["sinks"] = sinks.detach().float().clone()
        if fp8:
            tensors["k_scale"] = k_scale.detach().float().reshape(1).clone()
            tensors["v_scale"] = v_scale.detach().float().reshape(1).clone()
        return AttentionSnapshot(
            tensors,
            rows=rows,
            fp8=fp8,
            scale=float(scale),
            sliding_window=sliding_window,
            softcap=float(softcap),
        )


# --- KV-cache writes -------------------------------------------------------------------------


def _check_cache_rows(
    got: torch.Tensor,
    want: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor | None,
    what: str,
) -> Outcome | None:
    """Cache rows (bytes for fp8) vs the rows the reference writes: bit-exact."""
    from fuselane.kernels.kv_cache import quantize_e4m3_reference

    valid = slots >= 0
    if not bool(valid.any()):
        return None
    got, want = got[valid], want[valid]
    if scale is not None:  # fp8: compare the e4m3 values (exact), report dequantized errors
        want = quantize_e4m3_reference(want, scale).float() * scale.float()
        got = got.view(FP8).float() * scale.float()
    return compare(got, want, 0.0, 0.0, what)


class KVWriteSnapshot(Snapshot):
    kernel = "kv_cache"

    def check(self) -> Outcome | None:
        t = self.tensors
        k = _check_cache_rows(t["kc"], t["key"], t["slots"], t.get("k_scale"), "key cache rows")
        v = _check_cache_rows(t["vc"], t["value"], t["slots"], t.get("v_scale"), "value rows")
        if k is None or v is None:
            return None
        return k.merge(v)


class KVWriteCheck:
    """Snapshots of `fuselane.kernels.kv_cache.kv_cache_update` calls."""

    before = None

    def after(
        self,
        pre: Any,
        result: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> Snapshot | None:
        n = slot_mapping.shape[0]
        if n == 0:
            return None
        idx = _spread(n, key.device)
        slots = slot_mapping.index_select(0, idx).long()
        tensors = {
            "key": key.index_select(0, idx),
            "value": value.index_select(0, idx),
            "slots": slots,
            "kc": _gather_rows(key_cache, slots),
            "vc": _gather_rows(value_cache, slots),
        }
        if key_cache.dtype == FP8:
            tensors["k_scale"] = k_scale.detach().float().reshape(1).clone()
            tensors["v_scale"] = v_scale.detach().float().reshape(1).clone()
        return KVWriteSnapshot(tensors)


class RopeKVWriteSnapshot(Snapshot):
    kernel = "rope_kv_cache"

    def check(self) -> Outcome | None:
        from fuselane.kernels.kv_cache import rotary_reference

        t, is_neox = self.tensors, self.info["is_neox"]
        positions = torch.arange(t["q_in"].shape[0])  # rows of the gathered cos/sin table
        q_ref = rotary_reference(positions, t["q_in"], t["cos_sin"], is_neox)
        k_ref = rotary_reference(positions, t["k_in"], t["cos_sin"], is_neox)
        atol, rtol = ROTARY_TOLERANCES.get(q_ref.dtype, (1.6e-2, 1.6e-2))
        out = compare(t["q_out"], q_ref, atol, rtol, "rotated query")
        out = out.merge(compare(t["k_out"], k_ref, atol, rtol, "rotated key"))
        # The cache holds the key as written back (the kernel's contract), bit for bit.
        for got, want, scale, what in (
            (t["kc"], t["k_out"], t.get("k_scale"), "key cache rows"),
            (t["vc"], t["v_in"], t.get("v_scale"), "value cache rows"),
        ):
            rows = _check_cache_rows(got, want, t["slots"], scale, what)
            if rows is not None:
                out = out.merge(rows)
        return out


class RopeKVWriteCheck:
    """Snapshots of `fuselane.kernels.kv_cache.rope_kv_cache_update` calls (in place: the
    inputs are kept before the launch)."""

    def before(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        *args: Any,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor] | None:
        num_rows = query.shape[0]
        if num_rows == 0:
            return None
        idx = _spread(num_rows, query.device)
        pos = positions.index_select(0, idx).long().clamp(0, cos_sin_cache.shape[0] - 1)
        return {
            "idx": idx,
            "q_in": query.index_select(0, idx),
            "k_in": key.index_select(0, idx),
            "cos_sin": cos_sin_cache.index_select(0, pos),
        }

    def after(
        self,
        pre: dict[str, torch.Tensor] | None,
        result: Any,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> Snapshot | None:
        if pre is None:
            return None
        idx = pre.pop("idx")
        n = slot_mapping.shape[0]
        if n > 0:  # rows past len(slot_mapping) are rotated but not written
            written = slot_mapping.index_select(0, idx.clamp(max=n - 1)).long()
            slots = torch.where(idx < n, written, -1)
        else:
            slots = torch.full_like(idx, -1)
        tensors = dict(
            pre,
            q_out=query.index_select(0, idx),
            k_out=key.index_select(0, idx),
            v_in=value.index_select(0, idx),
            slots=slots,
            kc=_gather_rows(key_cache, slots),
            vc=_gather_rows(value_cache, slots),
        )
        if key_cache.dtype == FP8:
            tensors["k_scale"] = k_scale.detach().float().reshape(1).clone()
            tensors["v_scale"] = v_scale.detach().float().reshape(1).clone()
        return RopeKVWriteSnapshot(tensors, is_neox=bool(is_neox))


# --- sampling --------------------------------------------------------------------------------

# SamplingParamsTensors fields: per batch row, and per request-state slot.
_ROW_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seeds",
    "has_seed",
    "seed_offsets",
)
_SLOT_FIELDS = (
    "prompt_bin_mask",
    "output_bin_counts",
    "output_bin_mask",
    "logit_bias_counts",
    "logit_bias_token_ids",
    "logit_bias_values",
)


class SamplingSnapshot(Snapshot):
    kernel = "sampling"

    def check(self) -> Outcome | None:
        from fuselane.kernels import sampling as S

        t, info = self.tensors, self.info
        params = S.SamplingParamsTensors(
            **{f: t[f] for f in (*_ROW_FIELDS, *_SLOT_FIELDS) if f in t}
        )
        x = t["logits"].to(torch.float32)
        x = torch.where(torch.isnan(x), float("-inf"), x)  # the kernel's NaN policy
        y = S.apply_penalties_reference(S.apply_bias_reference(x, params), params)
        z_pre, greedy_rows = S.apply_temperature_reference(y, params.temperature)
        z = S.top_k_top_p_reference(
            S.apply_min_p_reference(z_pre, params.min_p), params.top_k, params.top_p
        )
        kept = z[0] > float("-inf")
        tok = int(t["token"][0])
        greedy = bool(greedy_rows[0])
        problems = []
        mismatched = 0
        if not 0 <= tok < x.shape[1]:
            problems.append(f"token id {tok} outside the vocabulary")
            mismatched += 1
        elif greedy:
            if bool(torch.isfinite(y[0]).any()) and not bool(y[0, tok] == y[0].max()):
                problems.append(f"greedy row chose {tok}, not an argmax")
                mismatched += 1
        elif not bool(kept[tok]):
            problems.append(f"chose {tok}, outside the reference's kept set")
            mismatched += 1
        if not greedy and "kept_count" in t:
            ref_kept = int(kept.sum())
            diff = abs(int(t["kept_count"][0]) - ref_kept)
            if diff > max(1, math.ceil(0.01 * ref_kept)):
                problems.append(f"kept {int(t['kept_count'][0])} tokens, reference {ref_kept}")
                mismatched += diff
        out = Outcome(not problems, mismatched=mismatched, detail="; ".join(problems))
        if "logprob" in t and 0 <= tok < x.shape[1]:
            mode = info["logprobs_mode"]
            values = {
                "raw_logprobs": lambda: x.log_softmax(-1),
                "raw_logits": lambda: x,
                "processed_logits": lambda: z,
                "processed_logprobs": lambda: z.double().log_softmax(-1).float(),
            }[mode]()
            atol, rtol = LOGPROB_TOLERANCE
            out = out.merge(
                compare(t["logprob"], values[0, tok].reshape(1), atol, rtol, "chosen logprob")
            )
        return out


class SamplingCheck:
    """Snapshots of `fuselane.kernels.sampling.fused_sample` calls (one row per check). With
    `logits_writable` the kernel may write penalized values into the logits, so the row is
    kept before the launch."""

    def __init__(self) -> None:
        self._pick = _Rotating()

    def before(
        self, logits: torch.Tensor, params: Any, **kwargs: Any
    ) -> tuple[int, torch.Tensor] | None:
        num_rows = logits.shape[0]
        if num_rows == 0:
            return None
        b = self._pick.next(num_rows)
        return b, logits[b : b + 1].clone()

    def after(
        self,
        pre: tuple[int, torch.Tensor] | None,
        out: Any,
        logits: torch.Tensor,
        params: Any,
        *,
        workspace: Any = None,
        num_logprobs: int | None = 0,
        logprobs_mode: str = "raw_logprobs",
        logits_writable: bool = False,
    ) -> Snapshot | None:
        if pre is None:
            return None
        b, row = pre
        tensors = {"logits": row, "token": out.token_ids[b : b + 1].clone()}
        for name in _ROW_FIELDS:
            value = getattr(params, name)
            if value is not None:
                tensors[name] = value[b : b + 1].clone()
        slot = (
            params.state_slots[b : b + 1].long()
            if params.state_slots is not None
            else torch.full((1,), b, dtype=torch.long, device=logits.device)
        )
        for name in _SLOT_FIELDS:
            value = getattr(params, name)
            if value is not None:
                tensors[name] = value.index_select(0, slot)
        if num_logprobs is not None and out.logprob is not None:
            tensors["logprob"] = out.logprob[b : b + 1].clone()
        if out.kept_count is not None:
            tensors["kept_count"] = out.kept_count[b : b + 1].clone()
        return SamplingSnapshot(tensors, logprobs_mode=logprobs_mode)


CHECKS: dict[str, Callable[[], Any]] = {
    "attention": AttentionCheck,
    "kv_cache": KVWriteCheck,
    "rope_kv_cache": RopeKVWriteCheck,
    "sampling": SamplingCheck,
}


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class CheckWorker:
    """Runs checks on a daemon thread; `record(site, outcome_or_error)` receives each result."""

    def __init__(
        self,
        record: Callable[[int, Outcome | BaseException], None],
        guard: Callable[[], AbstractContextManager[bool]] | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._record = record
        self._guard = guard or (lambda: nullcontext(True))
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="fuselane-checks", daemon=True)
        self._thread.start()

    def submit(self, site: int, snapshot: Snapshot) -> bool:
        """Queue a check; False (dropped) when the worker is behind."""
        try:
            self._queue.put_nowait((site, snapshot))
            return True
        except queue.Full:
            return False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued check has been recorded (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return self._queue.unfinished_tasks == 0

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self._queue.put((None, None), timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            site, snapshot = self._queue.get()
            try:
                if snapshot is None:
                    return
                while not snapshot.ready(self._guard):
                    time.sleep(0.005)
                try:
                    outcome = snapshot.check()
                except Exception as e:  # noqa: BLE001 - a broken check is reported, not fatal
                    outcome = e
                if outcome is not None:
                    self._record(site, outcome)
            finally:
                self._queue.task_done()

"""The fused sampler's device scratch and outputs, allocated once per engine."""

from __future__ import annotations

import torch

from .._checks import check_choice
from .._launch import cdiv
from .plan import (
    CAP,
    MAX_LOGPROBS,
    MIN_CHUNK,
    _topn_width,
    pick_chunk,
    row_launch,
    use_one_launch,
)

ARITH_MODES = ("triton", "torch")


class SamplingWorkspace:
    """Fixed device scratch and outputs for `fused_sample`, sized once for (max_batch, vocab).

    Reusing one workspace keeps the hot call free of allocations (CUDA-graph safe). The returned
    SampleOutput tensors are views into it: the next call overwrites them.
    """

    def __init__(self) -> None:  # use allocate()
        self.max_batch = 0

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        vocab: int,
        device: torch.device | str,
        *,
        max_logprobs: int = 20,
        chunk: int | None = None,
        cap: int = CAP,
        chunk_warps: int | None = None,
        maxnreg: int | None = None,
        arith: str = "triton",
        one_launch: bool | None = None,
        row_cap: int | None = None,
    ) -> SamplingWorkspace:
        """chunk, cap, chunk_warps (warps of the chunk kernel) and maxnreg (its register cap;
        both apply only with chunk) override the launch rule: tests use tiny chunk/cap to
        exercise every path, the benchmark's --sweep times alternatives.

        arith: the rounding of temperature and penalties on a GPU (`penalties.div`):
        "triton" (Triton's own fp32 arithmetic, div.full.f32 and fused multiply-adds, as vLLM
        V2's sampler kernels compute) or "torch" (IEEE division and each product rounded, as
        the references and vLLM's V1 sampler compute; 8-40% slower at B=32-256 on an H200,
        sampling-arith-torch-h200-2026-11-26.json against sampling-h200-2026-11-26.json). The
        two differ by at most 2 ulp per value, and not at all under Triton's interpreter.

        one_launch: None = the rule (`plan.use_one_launch`; two launches whenever `chunk` is
        given), True / False = always one launch (the whole row in one program, `chunk` then
        its chunk) / always two. row_cap: the one-launch kernel's candidates per chunk
        (a power of two; default `plan.row_launch`'s), small in tests to force its fallback."""
        check_choice("arith", arith, ARITH_MODES)
        if max_batch < 1 or vocab < 1:
            raise ValueError(f"max_batch and vocab: expected >= 1, got {max_batch}, {vocab}")
        if not 0 <= max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs: expected a value in [0, {MAX_LOGPROBS}], got {max_logprobs}"
            )
        if chunk is not None and (chunk < MIN_CHUNK or chunk & (chunk - 1)):
            raise ValueError(f"chunk: expected a power of two >= {MIN_CHUNK}, got {chunk}")
        if cap < 2 or cap & (cap - 1):
            raise ValueError(f"cap: expected a power of two >= 2, got {cap}")
        if row_cap is not None and (row_cap < 2 or row_cap & (row_cap - 1)):
            raise ValueError(f"row_cap: expected a power of two >= 2, got {row_cap}")
        ws = cls()
        device = torch.device(device)
        ws.device, ws.max_batch, ws.vocab = device, max_batch, vocab
        ws.max_logprobs, ws.chunk, ws.cap = max_logprobs, chunk, cap
        ws.chunk_warps, ws.maxnreg = chunk_warps or 0, maxnreg or 0
        ws.arith = arith
        ws.one_launch, ws.row_cap = one_launch, row_cap or 0
        # Planes hold one entry per (row, chunk); size for the largest grid of any batch size.
        if chunk is not None:
            plane = max_batch * cdiv(vocab, chunk)
        else:
            plane = max(b * cdiv(vocab, pick_chunk(b, vocab)) for b in range(1, max_batch + 1))
        # the one-launch kernel's rows: NC entries and NC * row cap candidates each
        if one_launch is None:  # the rule's largest one-launch batch (top-p alone: the most)
            ones = [b for b in range(1, max_batch + 1) if use_one_launch(b, vocab, True)]
            rows = max(ones, default=0) if chunk is None else 0
        else:
            rows = max_batch if one_launch else 0
        row_chunk, rcap, _ = row_launch(vocab, chunk or 0, row_cap or 0)
        row_entries = rows * cdiv(vocab, row_chunk)
        plane = max(plane, row_entries)
        ws.plane = plane
        slots = max(plane * cap, row_entries * rcap)
        f32, i32, i64 = torch.float32, torch.int32, torch.int64
        ws.stats_f = torch.zeros(8, plane, dtype=f32, device=device)
        ws.device = ws.stats_f.device  # resolved, "cuda" -> "cuda:0", to compare with inputs
        ws.stats_i = torch.zeros(6, plane, dtype=i32, device=device)
        ws.cand = torch.zeros(slots, dtype=i64, device=device)
        ws.rcand = torch.zeros(slots, dtype=i64, device=device)
        ws.rand_seeds = torch.zeros(max_batch, dtype=i64, device=device)
        ws.token_ids = torch.zeros(max_batch, dtype=i64, device=device)
        ws.logprob = torch.zeros(max_batch, dtype=f32, device=device)
        nlp = max(1, max_logprobs)
        ws.topn_ids = torch.zeros(max_batch * nlp, dtype=i64, device=device)
        ws.topn_logprobs = torch.zeros(max_batch * nlp, dtype=f32, device=device)
        ws.nan_rows = torch.zeros(max_batch, dtype=i32, device=device)
        ws.kept_threshold = torch.zeros(max_batch, dtype=f32, device=device)
        ws.kept_count = torch.zeros(max_batch, dtype=i32, device=device)
        ws.fallback_rows = torch.zeros(max_batch, dtype=i32, device=device)
        ws.scratch = torch.zeros(max_batch * 2 * _topn_width(nlp), dtype=i64, device=device)
        return ws

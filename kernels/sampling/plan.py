"""The fused sampler's constants and launch rule (chunk size, warps, register cap) from the
batch and vocabulary sizes alone; no autotuning."""

from __future__ import annotations

from .._launch import cdiv

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logits", "processed_logprobs")
_MODE_CODE = {
    None: 0,
    "raw_logprobs": 1,
    "raw_logits": 2,
    "processed_logits": 3,
    "processed_logprobs": 4,
}
MAX_LOGPROBS = 128  # top-n beyond this is left to vLLM's own path

# Launch configuration (chunk, chunk-kernel warps, register cap), measured on an H100
# (sampling-h100-80gb-hbm3-2026-11-25-sweep.json; the numbers in docs/tuning/sampling.md): a grid
# of at most one program per SM keeps whole 4096-chunks at 8 warps (B=1: 32 programs); up to
# SMALL_CHUNK_PROGRAMS programs use 2048-chunks at 4 warps; larger grids 4096-chunks at 4 warps,
# capped at 128 registers when penalties are on (four programs per SM instead of three).
# Penalties written in place take the plain rule (...-fused-walk-sweep.json).
CHUNK_SMALL = 2048
CHUNK_LARGE = 4096
ONE_WAVE_PROGRAMS = 132
SMALL_CHUNK_PROGRAMS = 2048
LARGE_GRID_WARPS = 4
LARGE_GRID_MAXNREG_PEN = 128
MIN_CHUNK = 128
COMBINE_MAXNREG = 128
CAP = 64  # candidates kept per chunk; rows whose kept set does not fit take the exact fallback
FB_TILE = 256  # fallback pass tile (elements)
SURVIVORS = 64  # top-k / min-p survivors gathered for top-p and the draw (else list searches)
FB_PIVOTS = 16  # fallback key search: pivots per pass (4 bits of the key per pass)
BIAS_BLOCK = 16  # logit-bias entries loaded per step


# One launch for small batches (`row._sample_row_kernel`, grid (B,)): one program per row runs
# the chunk kernel's work over the row (chunks of up to ROW_CHUNK_MAX values held in registers,
# in turn) and then the combine kernel's, with a barrier between, so a step pays one launch and
# no second program's wait for the partials. Taken while the grid is at most
# ONE_LAUNCH_MAX_BATCH rows and the row fits one chunk: a shape-only rule (the batch and the
# vocabulary), so a CUDA graph captured for a batch shape keeps its path. H200
# (sampling_one_launch-h200-2026-11-26.json, T=0.7): at B <= 8, V = 32000 / 32768 one launch
# takes 23-26 us with top-k 50 + top-p 0.9 and 24-26 us with top-p 0.95 alone, against two
# launches' 11-22 us and 626-636 us (a top-p set larger than the two-launch candidate list
# sends the combine kernel's single program per row through its exact fallback in 256-value
# tiles; B=8 V=32000 T/k/p: 1024 us) and FlashInfer's 31-123 us. One launch is the rule there
# for the worst case (never above 46 us); the goal of <= 12 us is not met by either path.
ONE_LAUNCH_MAX_BATCH = 8
ONE_LAUNCH_MAX_VOCAB = 32768
# Top-p without top-k, whose kept set overflows the two-launch candidate list on flat rows,
# also takes one launch at any vocabulary up to ONE_LAUNCH_TOP_P_MAX_BATCH rows (the host knows
# it: vLLM passes no top-k tensor when no request asks for one). Same sweep, top-p 0.95 alone,
# B <= 16: one launch 24-100 us at V = 32000 / 32768 / 128256 against two launches' 626-2894 us
# and FlashInfer's 31-152 us. Larger batches are not measured.
ONE_LAUNCH_TOP_P_MAX_BATCH = 16
# Values of a row held at once: 32 fp32 per thread at 16 warps, the whole row up to 32768.
# ptxas -v (sm_90a, T/k/p variant): 32768 spills ~600 bytes, 16384 72, 8192 none; measured
# 32768 the fastest (24.2 / 23.3 us at B=1 V=32000 against 27.1 / 26.2 at 16384 and 36.8 /
# 36.7 at 8192, same JSON).
ROW_CHUNK_MAX = 32768
ROW_CAP = 2048  # upper bound of the candidates a one-launch chunk keeps (row_launch)
ROW_WARPS_MAX = 16
ROW_FB_TILE = 2048  # fallback pass tile of the one-launch kernel (16 warps: 4 per thread)


def use_one_launch(batch: int, vocab: int, top_p_only: bool = False) -> bool:
    """Whether `fused_sample` samples a [batch, vocab] batch in one launch (the rule above);
    `top_p_only`: the batch has top-p and no top-k."""
    if top_p_only and batch <= ONE_LAUNCH_TOP_P_MAX_BATCH:
        return True
    return batch <= ONE_LAUNCH_MAX_BATCH and vocab <= ONE_LAUNCH_MAX_VOCAB


def row_launch(vocab: int, chunk: int = 0, cap: int = 0) -> tuple[int, int, int]:
    """(chunk, candidates per chunk, warps) of the one-launch kernel: the row as one power-of-two
    chunk up to ROW_CHUNK_MAX (else chunks of that size, in turn); 1/16 of a chunk listed (a
    median ~1450 values of a 32768 row: simulated on the benchmark's logits, T=0.7, the top-p
    0.95 set of every row fits, <= 607 tokens; flatter rows take the exact fallback), at least
    CAP; warps for 16 values per thread, at least 4 (the combine's list work), at most
    ROW_WARPS_MAX.
    `chunk` / `cap` override (tests, the sweep)."""
    chunk = chunk or max(MIN_CHUNK, min(ROW_CHUNK_MAX, _next_pow2(vocab)))
    cap = cap or min(ROW_CAP, max(CAP, chunk // 16))
    return chunk, cap, max(4, min(ROW_WARPS_MAX, chunk // 512))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Widths of the combine kernel's top-n list (TP, powers of two): a request for n logprobs runs
# the narrowest that holds n, so a serving run meets at most these few combine-kernel variants
# (a width per power of two had vLLM compile one mid-serving for the first logprobs=5 batch
# after start-up compiled another). None below 2: Triton 3.6's `tl.topk(x, 1)` does not
# compile for the GPU (its last merge step reduces the list to a scalar and the reshape after
# it fails). The widest, MAX_LOGPROBS, costs the most per row: only requests above 32 use it.
TOPN_WIDTHS = (8, 32, MAX_LOGPROBS)


def _topn_width(num_logprobs: int) -> int:
    """The top-n list width for `num_logprobs` (<= MAX_LOGPROBS; 0 gets the narrowest)."""
    return next(w for w in TOPN_WIDTHS if w >= num_logprobs)


def chunk_warps_for(chunk: int) -> int:
    """Warps that give the chunk kernel 16 fp32 values per thread (1 to 16)."""
    return max(1, min(16, chunk // 512))


def pick_launch(batch: int, vocab: int, *, penalties: bool = False) -> tuple[int, int, int]:
    """(chunk, chunk-kernel warps, register cap or 0) for a batch (see the launch-configuration
    note): one chunk for small vocabularies; whole 4096-chunks at 8 warps while the grid is
    within one program per SM; 2048-chunks at 4 warps up to SMALL_CHUNK_PROGRAMS programs;
    else 4096-chunks at 4 warps, with a 128-register cap when penalties are on. The chunk
    does not depend on `penalties`."""
    if vocab <= CHUNK_LARGE:
        chunk = max(MIN_CHUNK, _next_pow2(vocab))
        return chunk, chunk_warps_for(chunk), 0
    if batch * cdiv(vocab, CHUNK_LARGE) <= ONE_WAVE_PROGRAMS:
        return CHUNK_LARGE, 8, 0
    if batch * cdiv(vocab, CHUNK_SMALL) <= SMALL_CHUNK_PROGRAMS:
        return CHUNK_SMALL, 4, 0
    return CHUNK_LARGE, LARGE_GRID_WARPS, LARGE_GRID_MAXNREG_PEN if penalties else 0


def pick_chunk(batch: int, vocab: int) -> int:
    """The chunk size pick_launch chooses."""
    return pick_launch(batch, vocab)[0]


def launch_plan(
    batch: int, vocab: int, top_p_only: bool = False
) -> tuple[bool, tuple[int, int, int]]:
    """(one launch?, its configuration): `row_launch` where `use_one_launch`, else
    `pick_launch`."""
    if use_one_launch(batch, vocab, top_p_only):
        return True, row_launch(vocab)
    return False, pick_launch(batch, vocab)


def launch_batches(max_batch: int, vocab: int, top_p_only: bool = False) -> list[int]:
    """The smallest batch of each launch configuration `launch_plan` gives batches
    1..max_batch (at most five: the configuration changes only at four thresholds)."""
    firsts: dict[tuple[bool, tuple[int, int, int]], int] = {}
    for b in range(1, max_batch + 1):
        firsts.setdefault(launch_plan(b, vocab, top_p_only), b)
    return sorted(firsts.values())

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


def launch_batches(max_batch: int, vocab: int) -> list[int]:
    """The smallest batch of each launch configuration `pick_launch` gives batches 1..max_batch
    (at most three: the configuration changes only at two thresholds)."""
    firsts: dict[tuple[int, int, int], int] = {}
    for b in range(1, max_batch + 1):
        firsts.setdefault(pick_launch(b, vocab), b)
    return sorted(firsts.values())

"""What both fused samplers (V1, V2) share: their telemetry seams and batch counts, the
logprob output, the start-up warm-up and the switch that sends every batch to vLLM's sampler."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from . import telemetry, vllm_compat, warmup

_SAMPLING = telemetry.seam(telemetry.SAMPLING)
_SAMPLING_STOCK = telemetry.seam(telemetry.SAMPLING, impl=telemetry.STOCK)

_COUNTS: Counter = Counter()
_LOCK = threading.Lock()
FUSED_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")
SEED_BOUND = 1 << 62


def counters() -> dict[str, int]:
    """This process's batch counts: `fused`, `stock` and `stock:<reason>`."""
    with _LOCK:
        return dict(_COUNTS)


def reset_counters() -> None:
    with _LOCK:
        _COUNTS.clear()


def _count(key: str, reason: str | None = None) -> None:
    with _LOCK:
        _COUNTS[key] += 1
        if reason:
            _COUNTS[f"{key}:{reason}"] += 1


def _logprobs_tensors(
    out: Any, sampled: torch.Tensor, logits: torch.Tensor, n: int | None, ids_dtype: torch.dtype
) -> Any:
    """vLLM's LogprobsTensors from the kernel's outputs (None when no logprobs were asked):
    the chosen token, then its top n (-1 padding of rows with fewer finite values becomes 0),
    and vLLM's rank of the chosen token: how many raw logits are >= it (V1's log_softmax and
    V2's _ranks_kernel order tokens alike)."""
    if n is None:
        return None
    ids = [sampled.unsqueeze(-1)]
    lps = [out.logprob.unsqueeze(-1)]
    if n > 0:
        ids.append(out.topn_ids.clamp(min=0))
        lps.append(out.topn_logprobs)
    ranks = (logits >= logits.gather(-1, sampled.unsqueeze(-1))).sum(-1)
    return vllm_compat.LogprobsTensors(
        torch.cat(ids, dim=1).to(ids_dtype), torch.cat(lps, dim=1).to(torch.float32), ranks
    )


# Parameter sets whose kernel variants start-up compiles (kernels.sampling.warm_up): greedy and
# the usual temperature / top-k / top-p mixes, and that mix with penalties (both runners pass
# output counts without presence bits). vLLM 0.26's JIT monitor named both sampling kernels
# compiling at the first penalized requests on the V1 runner before the penalty set was here;
# each set adds one compile per launch configuration to start-up. V1 always passes a
# temperature (zeros for an all-greedy batch) and seeds only with seeded requests (the mix with
# them is warmed: fuselane's late-variant report named it on an H100, 2026-11-27); V2 passes
# seeds for every row and no temperature when every row has temperature 1.
V1_WARM_PARAM_SETS = (
    ("temperature",), ("temperature", "top_k", "top_p"), ("temperature", "top_p"),
    ("temperature", "top_k"), ("temperature", "top_k", "top_p", "penalties"),
    ("temperature", "top_k", "top_p", "seeded"),
)  # fmt: skip
V2_WARM_PARAM_SETS = (
    (), ("temperature",), ("temperature", "top_k", "top_p"), ("temperature", "top_p"),
    ("temperature", "top_k", "top_p", "penalties"),
)  # fmt: skip
# A batch asking for logprobs runs other kernel variants than one asking none: 0 (the chosen
# token's) is one, and top-n one per list width (kernels.sampling.TOPN_WIDTHS). Start-up also
# compiles 0 and the two narrowest widths (up to 8, up to 32) for greedy and the usual
# sampling mix; otherwise the first request with `logprobs` stalls its step for the compile
# (vLLM 0.26's JIT monitor named both sampling kernels on an H200, 2026-11-26). Above 32 (vLLM
# allows 20 by default) the first such request compiles the widest.
WARM_TOPN_WIDTHS = 2
WARM_LOGPROB_PARAM_SETS = (("temperature",), ("temperature", "top_k", "top_p"))
# The kernel's rounding (kernels.sampling.ARITH_MODES) for both runners: Triton's, which is
# what V2's own sampler kernels compute (so the fused tokens stay V2's bit for bit on a GPU).
# V1's torch sampler rounds each operation; matching it costs 8-40% of the kernel's time at
# B=32-256 (sampling-arith-torch-h200-2026-11-26.json against sampling-h200-2026-11-26.json),
# and V1's fused draws already differ from its stock ones, so V1 takes the fast rounding too.
V1_ARITH = V2_ARITH = "triton"


def route(
    reason: str | None, fused: Callable[[], Any], stock: Callable[..., Any], *args: Any,
    **kwargs: Any,
) -> Any:  # fmt: skip
    """A sampler call's route: `fused()` when nothing stands against it (`reason` None) and it
    ran (not None: its start-up warm-up may switch fused sampling off, counted "startup"), else
    vLLM's sampler, `stock(*args, **kwargs)`, through the stock seam (which times it on the
    device of the first tensor argument); each call counted by route and reason."""
    if reason is None:
        out = fused()
        if out is not None:
            _count("fused")
            return out
        reason = "startup"
    _count("stock", reason)
    return _SAMPLING_STOCK(None, stock, *args, **kwargs)


def run_fused(
    sampler: Any, runner: str, logits: torch.Tensor, params: Any, n: int | None, mode: str,
    param_sets: tuple[tuple[str, ...], ...],
) -> Any:  # fmt: skip
    """The fused sampler's call for either runner: the start-up warm-up on the sampler's first
    call, then `fused_sample` through the telemetry seam. None when the warm-up switched fused
    sampling off (the caller runs vLLM's sampler). `logits_writable` when no log-probabilities
    are asked for: neither runner reads its logits after sampling then."""
    from fuselane.kernels import sampling

    ws = sampler._workspace(logits)
    if not sampler._fuselane_warmed:
        sampler._fuselane_warmed = _warm_up(runner, logits, params, ws, n, mode, param_sets)
        if fused_sampling_off() is not None:
            return None
    return _SAMPLING(
        None, sampling.fused_sample, logits, params, workspace=ws, num_logprobs=n,
        logprobs_mode=mode, logits_writable=n is None,
    )  # fmt: skip


def _warm_up(
    runner: str, logits: torch.Tensor, params: Any, ws: Any, n: int | None, mode: str,
    param_sets: tuple[tuple[str, ...], ...],
) -> bool:  # fmt: skip
    """Compile the sampling kernels' common variants on the sampler's first call (vLLM's dummy
    sampler run at start-up); True once done (plugin/warmup.py)."""
    from fuselane.kernels import sampling

    key = ("sampling", runner, str(logits.device), logits.dtype, ws.vocab, ws.max_batch, n, mode)

    def compile_all() -> int:
        # as run_fused passes it: a penalized batch runs in place when nothing reads its logits
        calls = sampling.warm_up(
            params, ws, logits.dtype, param_sets=param_sets, num_logprobs=n, logprobs_mode=mode,
            logits_writable=n is None,
        )  # fmt: skip
        # the smallest logprob count of each list width: 1, then one past each narrower width
        firsts = (1, *(w + 1 for w in sampling.TOPN_WIDTHS[:-1]))
        for extra in (0, *firsts[:WARM_TOPN_WIDTHS]):
            if extra != n:
                calls += sampling.warm_up(
                    params, ws, logits.dtype, param_sets=WARM_LOGPROB_PARAM_SETS,
                    num_logprobs=extra, logprobs_mode=mode,
                )  # fmt: skip
        return calls

    try:
        return warmup.once("sampling", key, logits.device, compile_all)
    except Exception as e:  # noqa: BLE001 - any failure here must not stop the engine
        # A variant that cannot compile or launch here: vLLM's sampler takes every batch of
        # this process, rather than one failing while serving.
        disable_fused_sampling(f"{type(e).__name__} at start-up: {e}"[:500])
        return True


# Why fused sampling is off in this process (None: on).
_fused_off: str | None = None


def disable_fused_sampling(reason: str) -> None:
    """Send every later batch of this process to vLLM's sampler (counted `stock:startup`)."""
    global _fused_off
    _fused_off = reason
    vllm_compat.get_logger().warning(
        "fuselane: the sampling kernel failed its start-up warm-up (%s); vLLM's sampler runs "
        "every batch of this process",
        reason,
    )


def fused_sampling_off() -> str | None:
    """Why fused sampling is off in this process (None: on)."""
    return _fused_off

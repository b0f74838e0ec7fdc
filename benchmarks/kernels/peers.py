"""The peers `fuselane bench kernels` times fuselane against, and FlashInfer's JIT builds.

Peers are optional: whatever imports is timed, whatever does not is named in the results
(`import_peer`, which the per-family scripts and bench_host_overhead import theirs with too).
- vllm: vLLM's own Triton kernels (`unified_attention`, TRITON_ATTN's kernel, and
  `triton_reshape_and_cache_flash`), from an installed vLLM or the staged kernel files;
- flashinfer: paged decode/prefill wrappers, `append_paged_kv_cache`, top-k/top-p sampling;
- torch: SDPA, `index_copy_`, the sort-based sampling path vLLM falls back to.

FlashInfer builds each kernel variant the first time it is used: about 20 s for a decode
variant and 80 s for a Hopper prefill one on an H200 (docs/tuning/attention.md), several
minutes for a whole grid, built one after another. `FlashInferWarmup` builds them instead in
child processes (public API calls on tiny inputs, at lower CPU priority) while this process
times everything else; FlashInfer's rows are timed once their module is on disk. The children
use the GPU only for a few tiny launches, and a separate process cannot disturb this one's
CUDA-graph captures, as a thread could.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

PEERS: tuple[str, ...] = ("vllm", "flashinfer", "torch")
# Children building at once: a Hopper prefill module is 10 nvcc processes of several GB each.
WARM_PARALLEL = 2
WARM_MAX_JOBS = "8"  # ninja jobs per child (FlashInfer reads MAX_JOBS)
FI_WORKSPACE_BYTES = 256 << 20


@dataclass
class Peers:
    enabled: frozenset[str]
    unified_attention: Callable[..., Any] | None = None
    reshape_and_cache_flash: Callable[..., Any] | None = None
    flashinfer: Any = None
    versions: dict[str, str] = field(default_factory=dict)
    _fi_workspace: torch.Tensor | None = None

    @property
    def torch(self) -> bool:
        return "torch" in self.enabled

    def fi_workspace(self, device: torch.device) -> torch.Tensor:
        if self._fi_workspace is None:
            self._fi_workspace = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._fi_workspace


# The optional peers a benchmark imports: (what a note calls it, module, attribute or None)
UNIFIED_ATTENTION = (
    "vllm unified_attention",
    "vllm.v1.attention.ops.triton_unified_attention",
    "unified_attention",
)
RESHAPE_AND_CACHE_FLASH = (
    "vllm triton_reshape_and_cache_flash",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "triton_reshape_and_cache_flash",
)
FLASHINFER = ("flashinfer", "flashinfer", None)


def import_peer(peer: tuple[str, str, str | None], note: Callable[[str], None]) -> Any:
    """The module or attribute `peer` names; None and a note if it does not import."""
    label, module, attr = peer
    try:
        imported = importlib.import_module(module)
        return imported if attr is None else getattr(imported, attr)
    except Exception as e:  # noqa: BLE001 - any import failure disables this peer
        note(f"{label} unavailable: {e!r}")
        return None


def discover(enabled: frozenset[str], note: Callable[[str], None]) -> Peers:
    """Import the enabled peers; what fails to import is noted and left out."""
    peers = Peers(enabled=enabled)
    peers.versions["torch"] = torch.__version__
    if "vllm" in enabled:
        peers.unified_attention = import_peer(UNIFIED_ATTENTION, note)
        peers.reshape_and_cache_flash = import_peer(RESHAPE_AND_CACHE_FLASH, note)
        if peers.unified_attention or peers.reshape_and_cache_flash:
            import vllm

            # the staged kernel files (no vllm install) carry no version
            peers.versions["vllm"] = getattr(vllm, "__version__", "Triton kernel files")
    if "flashinfer" in enabled:
        peers.flashinfer = import_peer(FLASHINFER, note)
        if peers.flashinfer is not None:
            peers.versions["flashinfer"] = getattr(peers.flashinfer, "__version__", "unknown")
    return peers


# ----------------------------------------------------------------------------------------------
# FlashInfer JIT builds in child processes
# ----------------------------------------------------------------------------------------------


class FlashInferWarmup:
    """Builds FlashInfer modules (one child process per spec, WARM_PARALLEL at a time).

    `state(key)` is "ready", "failed" or "pending"; `wait(key, deadline)` blocks until the
    build is done or the monotonic deadline passes. Specs are started in the order given.
    """

    def __init__(self, specs: dict[str, dict[str, Any]], note: Callable[[str], None]) -> None:
        self.queue = list(specs.items())
        self.note = note
        self.running: dict[str, tuple[subprocess.Popen, Any, float]] = {}
        self.done: dict[str, str] = {}
        self.build_s: dict[str, float] = {}
        self.nice = shutil.which("nice")
        self.poll()

    def _start(self, key: str, spec: dict[str, Any]) -> None:
        log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-c", _CHILD, json.dumps(spec)]
        if self.nice:
            cmd = [self.nice, "-n", "10", *cmd]  # the timed process keeps the CPU it needs
        env = {**os.environ, "MAX_JOBS": WARM_MAX_JOBS}
        try:
            # a session of its own: close() stops the child's nvcc processes with it
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except OSError as e:
            self.done[key] = "failed"
            self.note(f"FlashInfer build {key}: could not start a child process: {e!r}")
            log.close()
            return
        self.running[key] = (proc, log, time.monotonic())

    def poll(self) -> None:
        for key, (proc, log, t0) in list(self.running.items()):
            if proc.poll() is None:
                continue
            del self.running[key]
            self.build_s[key] = round(time.monotonic() - t0, 1)
            if proc.returncode == 0:
                self.done[key] = "ready"
            else:
                log.seek(0)
                tail = log.read()[-600:].strip().replace("\n", " | ")
                self.done[key] = "failed"
                self.note(f"FlashInfer build {key} failed (exit {proc.returncode}): {tail}")
            log.close()
        while self.queue and len(self.running) < WARM_PARALLEL:
            self._start(*self.queue.pop(0))

    def state(self, key: str) -> str:
        self.poll()
        return self.done.get(key, "pending")

    def wait(self, key: str, deadline: float | None) -> str:
        while (state := self.state(key)) == "pending":
            if deadline is not None and time.monotonic() > deadline:
                return state
            time.sleep(0.5)
        return state

    def close(self) -> None:
        """Stop the builds still running (their modules are not needed any more)."""
        self.queue.clear()
        for proc, log, _ in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        self.running.clear()


# Run in the child: `python -c _CHILD SPEC_JSON`.
_CHILD = "import sys; from fuselane.benchmarks.kernels.peers import warm; warm(sys.argv[1])"


def warm(spec_json: str) -> None:
    """Child process: make FlashInfer build (and load) the module `spec` names, through the
    same public calls the benchmark makes, on a one-page problem."""
    import flashinfer

    spec = json.loads(spec_json)
    dev = torch.device("cuda")
    i32 = dict(dtype=torch.int32, device=dev)
    bf16 = torch.bfloat16
    kind = spec["kind"]
    if kind in ("decode", "prefill"):
        hq, hkv, d, page = spec["num_q_heads"], spec["num_kv_heads"], spec["head_size"], 16
        ws = torch.zeros(16 << 20, dtype=torch.uint8, device=dev)
        # an fp8 cache is another module (the KV dtype is a template argument)
        kv_dtype = getattr(torch, spec.get("kv_dtype", "bfloat16"))
        one = dict(
            num_kv_heads=hkv,
            page_size=page,
            sm_scale=d**-0.5,
            q_data_type=bf16,
            kv_data_type=kv_dtype,
            window_left=spec["window_left"],
            logits_soft_cap=spec["softcap"] or None,
        )
        pages = (torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([1], **i32))
        if kind == "decode":
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            w.plan(*pages, num_qo_heads=hq, head_dim=d, **one)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(
                torch.tensor([0, 1], **i32),
                *pages,
                num_qo_heads=hq,
                head_dim_qk=d,
                causal=True,
                **one,
            )
    elif kind == "page":
        k = torch.zeros(1, 1, 64, dtype=bf16, device=dev)
        cache = torch.zeros(1, 16, 1, 64, dtype=bf16, device=dev)
        indptr, lens = torch.tensor([0, 1], **i32), torch.tensor([1], **i32)
        bi, pos = flashinfer.get_batch_indices_positions(indptr, lens, 1)
        flashinfer.append_paged_kv_cache(
            k, k, bi, pos, (cache, cache.clone()), torch.tensor([0], **i32), indptr, lens, "NHD"
        )
    elif kind == "sampling":
        import flashinfer.sampling as fis

        logits = torch.randn(1, 64, device=dev)
        fis.top_k_top_p_sampling_from_logits(
            logits, torch.tensor([5], **i32), torch.tensor([0.9], device=dev), deterministic=True
        )
    else:
        raise ValueError(f"unknown warm-up kind {kind!r}")
    torch.cuda.synchronize()

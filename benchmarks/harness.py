"""GPU timing harness shared by the kernel benchmarks.

Every benchmark times fuselane and its peers in one process, on one device, the same way:
the call is captured `calls_per_graph` times into one CUDA graph and the graph is replayed;
the median replay time over `reps` replays, divided by `calls_per_graph`, is the per-call time.
Graph replay removes host launch gaps, which is how vLLM runs these kernels in decode.

Results carry the device, the versions and the measured ceilings, so a JSON under
benchmarks/results/ says by itself what it was measured on.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_info() -> dict[str, object]:
    """Name, versions and size of the current CUDA device; without one, the host CPU's name
    (dry runs of a benchmark's logic under Triton's interpreter)."""
    versions = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if not torch.cuda.is_available():
        return {"device": f"cpu ({platform.machine()}, Triton interpreter)", **versions}
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        **versions,
    }


def time_graph(
    fn: Callable[[], object],
    *,
    calls_per_graph: int = 20,
    reps: int = 50,
    warmup: int = 3,
) -> float:
    """Median milliseconds per call of `fn`, timed by CUDA-graph replay with events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile, autotune caches, allocator warm-up
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(3):
        graph.replay()
    median = _median_event_ms(graph.replay, reps) / calls_per_graph
    del graph
    return median


def time_eager(fn: Callable[[], object], *, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds per call without graphs (for peers that cannot be captured)."""
    for _ in range(warmup):
        fn()
    return _median_event_ms(fn, reps)


def _median_event_ms(fn: Callable[[], object], reps: int) -> float:
    """Median of `reps` event-timed calls of `fn` (milliseconds), each waited for."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ceiling_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written.

    The best of two copies, timed eagerly: `copy_` (cudaMemcpyAsync) and an elementwise kernel
    writing `src + 0` (SMs doing the copy, as every kernel here does). Inside a CUDA graph a
    plain copy becomes a memcpy node served by the copy engines, measured on an H200 at
    2.76 TB/s against 4.2 TB/s eagerly, so graph replay would understate the ceiling.
    """
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms_copy = time_eager(lambda: dst.copy_(src), reps=20)
    ms_kernel = time_eager(lambda: torch.add(src, 0, out=dst), reps=20)
    return 2 * nbytes / (min(ms_copy, ms_kernel) * 1e-3) / 1e12


def gemm_ceiling_tflops(n: int = 8192) -> float:
    """bf16 matrix-product rate in TFLOP/s on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_graph(lambda: a @ b, calls_per_graph=3, reps=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


@triton.jit
def _empty_kernel(x_ptr, BLOCK: tl.constexpr):
    pass


def empty_kernel_ms() -> float:
    """Graph-replay time of an empty Triton kernel: the floor of any single launch."""
    _empty = _empty_kernel
    x = torch.empty(1, device="cuda")
    return time_graph(lambda: _empty[(1,)](x, BLOCK=1), calls_per_graph=100, reps=50)


@dataclass
class Row:
    section: str
    case: str
    impl: str
    ms: float
    nbytes: float | None = None
    flops: float | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def tbps(self) -> float | None:
        return None if self.nbytes is None else self.nbytes / (self.ms * 1e-3) / 1e12

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None else self.flops / (self.ms * 1e-3) / 1e12


class Report:
    """Rows of one benchmark run, with ratios against fuselane computed per case."""

    def __init__(self, name: str, ours: str = "fuselane") -> None:
        self.name = name
        self.ours = ours
        self.rows: list[Row] = []
        self.ceilings: dict[str, float] = {}
        self.info = device_info()
        self.notes: list[str] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def _ours(self, section: str, case: str) -> Row | None:
        for r in self.rows:
            if r.section == section and r.case == case and r.impl == self.ours:
                return r
        return None

    def as_dicts(self) -> list[dict[str, object]]:
        out = []
        copy = self.ceilings.get("copy_tbps")
        gemm = self.ceilings.get("gemm_tflops")
        for r in self.rows:
            d = asdict(r)
            d.pop("extra")
            d.update(r.extra)
            d["us"] = round(r.ms * 1e3, 3)
            if r.tbps is not None:
                d["TBps"] = round(r.tbps, 3)
                if copy:
                    d["pct_copy_ceiling"] = round(100 * r.tbps / copy, 1)
            if r.tflops is not None:
                d["TFLOPs"] = round(r.tflops, 1)
                if gemm:
                    d["pct_gemm_ceiling"] = round(100 * r.tflops / gemm, 1)
            ours = self._ours(r.section, r.case)
            if ours is not None and r.impl != self.ours:
                # > 1 means fuselane is faster than this peer
                d["peer_over_fuselane"] = round(r.ms / ours.ms, 3)
            out.append(d)
        return out

    def table(self) -> str:
        lines = [
            f"{'section':<16} {'case':<44} {'impl':<40} {'us':>9} {'TB/s':>6} {'TF/s':>6} "
            f"{'%ceil':>6} {'peer/ours':>9}"
        ]
        for d in self.as_dicts():
            pct = d.get("pct_copy_ceiling", d.get("pct_gemm_ceiling", ""))
            lines.append(
                f"{d['section']:<16} {d['case']:<44} {d['impl']:<40} {d['us']:>9.3f} "
                f"{d.get('TBps', ''):>6} {d.get('TFLOPs', ''):>6} {pct:>6} "
                f"{d.get('peer_over_fuselane', ''):>9}"
            )
        return "\n".join(lines)

    def write(self, out_dir: Path | None = None) -> Path:
        out_dir = out_dir or RESULTS_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = _dt.date.today().isoformat()
        dev = str(self.info["device"]).replace("NVIDIA ", "").replace(" ", "-").lower()
        path = out_dir / f"{self.name}-{dev}-{stamp}.json"
        payload = {
            "benchmark": self.name,
            "date": stamp,
            **self.info,
            "ceilings": self.ceilings,
            "notes": self.notes,
            "results": self.as_dicts(),
        }
        path.write_text(json.dumps(payload, indent=1) + "\n")
        return path


def peer_available(module: str) -> bool:
    """True if `module` imports (peers are optional; a missing one is reported, not fatal)."""
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - any import failure means the peer cannot be timed
        return False
    return True

"""The engine processes of the end-to-end run: starting one in its own process group, stopping
it with everything it spawned, ending the run's engines when the run is killed, waiting for a
server to answer, and reading what an engine's log says.

An engine left behind holds the GPU's memory, and the next engine then fails to start: every
engine runs inside `owned_process`, and `exit_on_termination` turns SIGTERM / SIGHUP into an
exception so that those blocks end (and stop their engines) when the run is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# What the engine log says, by topic (regexes, case-insensitive; matched lines are kept).
LOG_PATTERNS: dict[str, str] = {
    "backend": r"attention backend|Using \S+ backend|backend CUSTOM|attn_backend",
    "fuselane": r"fuselane",
    "compile": r"torch\.compile|Compiling a graph|compilation|Dynamo bytecode|inductor",
    "cuda_graphs": r"CUDA graph|cudagraph|Capturing",
    "graph_break": r"graph break|graph_break|Recompil",
    "fallback": r"fall(ing)? ?back|refused|not supported|not valid",
    "errors": r"Traceback|\bERROR\b|Error:|CUDA out of memory",
    "timing": r"init engine|took [0-9.]+ ?s|startup|Model loading took|Available KV cache",
    # kernels compiled while serving: vLLM's JIT monitor ("Triton JIT compilation during
    # inference: <kernel>") and fuselane's own line naming the argument its warm-up missed
    "late_compile": r"during inference|start-up warm-up did not launch",
}
LOG_LINES_PER_TOPIC = 25


def _group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group `pgid` is left (engine-core children hold GPU memory)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.5)
    return False


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a process started in its own process group, and everything it spawned; return
    when the whole group is gone, so the next engine finds the GPU memory free."""
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        if _group_gone(proc.pid, wait):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return


@contextlib.contextmanager
def owned_process(
    cmd: Sequence[str], env: dict[str, str], log: Any, stop_timeout: float = 30.0
) -> Iterator[subprocess.Popen]:
    """A child in its own process group, stopped with everything it spawned when the block
    ends, however it ends (an exception, or SIGTERM / SIGHUP through `exit_on_termination`):
    an engine left behind holds the GPU's memory, and the next engine fails to start."""
    proc = subprocess.Popen(
        list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield proc
    finally:
        _stop(proc, timeout=stop_timeout)


def exit_on_termination() -> None:
    """SIGTERM / SIGHUP (an outer `timeout`, a closed session) end the run as SystemExit, so
    `owned_process` blocks stop their engines; Python's default would end it on the spot."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def run_engine_process(
    cmd: Sequence[str], env: dict[str, str], log_path: Path, result_path: Path, timeout: float
) -> dict[str, Any]:
    """Run an engine process that writes its results as JSON to `result_path`, its output to
    `log_path`, for at most `timeout` s; its results (what it wrote before failing, too) with
    its exit, its wall time, an error where it failed, and what its log says."""
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log, owned_process(cmd, env, log, 10.0) as proc:
        try:
            rc: int | str = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res: dict[str, Any] = {}
    if result_path.exists():
        try:
            res = json.loads(result_path.read_text())
        except ValueError as e:
            res = {"error": f"unreadable worker result: {e}"}
    res["exit"] = rc
    res["process_s"] = time.perf_counter() - t0
    if rc != 0 and "error" not in res:
        res["error"] = f"offline engine process exit {rc}; see {log_path.name}"
    res.setdefault("status", "ok" if rc == 0 else "failed")
    res["log"] = scan_log(log_path.read_text(errors="replace"))
    res["log_file"] = str(log_path)
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_server(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    """Return once the server answers `/v1/models`; raise if it exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout:.0f}s")


def scan_log(text: str) -> dict[str, list[str]]:
    """Lines of an engine log by topic (LOG_PATTERNS), at most LOG_LINES_PER_TOPIC each."""
    found: dict[str, list[str]] = {}
    compiled = {k: re.compile(v, re.IGNORECASE) for k, v in LOG_PATTERNS.items()}
    for line in text.splitlines():
        for topic, rx in compiled.items():
            if rx.search(line):
                lines = found.setdefault(topic, [])
                if len(lines) < LOG_LINES_PER_TOPIC:
                    lines.append(line.strip()[:400])
    return found

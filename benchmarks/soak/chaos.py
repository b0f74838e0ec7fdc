"""What the soak does to the custom arm, and how it watches the canary's answer to it.

- `kill_custom_replica`: SIGKILL of a custom replica's process (Ray Serve's replica actor, the
  process that holds the vLLM engine client), the way a crashed or OOM-killed replica dies;
  Serve starts another. Its child processes (vLLM's EngineCore) are watched: they must go too.
- `redeploy_custom`: the custom arm's app deployed again with another environment (the fault
  switch on, then off): only the custom replicas restart, stock and the ingress keep serving.
- `RollbackWatch`: the canary's rollbacks as they happen, with the monitor's own time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fuselane.serving.canary import control, ray_compat
from fuselane.serving.canary.config import CanaryConfig


def custom_replicas(app: str) -> list[dict[str, Any]]:
    """The custom arm's replicas as Serve lists them: state, pid, node."""
    apps = ray_compat.serve_client().get_serve_details().get("applications") or {}
    dep = ((apps.get(f"{app}-custom") or {}).get("deployments") or {}).get("custom") or {}
    return [
        {"state": str(getattr(r["state"], "value", r["state"])), "pid": r.get("pid")}
        for r in dep.get("replicas") or []
    ]


def _children(pid: int) -> list[int]:
    """Every child of `pid`, whichever of its threads started it (vLLM's engine process is
    started from the replica's event-loop thread, not its main one)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def _descendants(root: int) -> list[int]:
    """The processes below `root` (this process started the local Ray: all of its are)."""
    out, i = [root], 0
    while i < len(out):
        out += _children(out[i])
        i += 1
    return out[1:]


def _starting_replica(app: str) -> int | None:
    """A custom replica's process before Serve lists its pid (it does once the replica has
    started): the actor's process title, among this process's descendants only."""
    title = f"ray::ServeReplica:{app}-custom:custom".encode()
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(title):
                    return pid
        except OSError:
            continue
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_custom_replica(
    app: str, wait_running_s: float = 0.0, wait_any_s: float = 0.0
) -> dict[str, Any]:
    """SIGKILL the process of a running custom replica, waiting up to `wait_running_s` for one
    to run; past that, of one that is starting (its engine not up yet), waiting up to
    `wait_any_s` for its process to exist. Returns what was killed and whether its children
    went within 30 s."""
    t0 = time.monotonic()
    target: dict[str, Any] | None = None
    while target is None:
        replicas = custom_replicas(app)
        waited = time.monotonic() - t0
        running = [r for r in replicas if r["state"] == "RUNNING" and r["pid"]]
        if running:
            target = running[0]
        elif waited >= wait_running_s:
            listed = [r for r in replicas if r["pid"]]
            if listed:
                target = listed[0]
            elif (pid := _starting_replica(app)) is not None:
                target = {"state": "STARTING", "pid": pid}
        if target is None:
            if waited >= max(wait_running_s, wait_any_s):
                break
            time.sleep(1.0)
    record: dict[str, Any] = {"at": time.time(), "waited_s": round(time.monotonic() - t0, 1)}
    if target is None:
        return record | {"killed": False, "why": "no custom replica process"}
    pid = int(target["pid"])
    children = _children(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return record | {"killed": False, "why": f"pid {pid} was already gone"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.5)
    left = [c for c in children if _alive(c)]
    return record | {
        "killed": True,
        "pid": pid,
        "state": target["state"],
        "children": len(children),
        "children_left_after_30s": len(left),
    }


def with_custom_env(config: CanaryConfig, env: dict[str, str]) -> CanaryConfig:
    """`config` with the custom arm's own environment replaced by `env`."""
    data = config.model_dump(mode="json")
    data["arms"]["custom"]["env"] = dict(env)
    return CanaryConfig.model_validate(data)


def redeploy_custom(config: CanaryConfig) -> float:
    """Apply `config` (the custom arm's app changes; the others are the same and keep
    running) without waiting for the new replicas; returns when it was applied."""
    control.deploy(config, wait_s=0)
    return time.time()


@dataclass
class RollbackWatch:
    """Polls the canary's status every `poll_s` from a thread; `rollbacks` holds each rollback
    the monitor recorded (its reason, detail and time), `snapshots` each change of a few status
    fields (the weight in force, rolled back, custom replicas running)."""

    app: str
    poll_s: float = 1.0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollback-watch", daemon=True)

    def start(self) -> RollbackWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def rolled_back_since(self, t: float) -> dict[str, Any] | None:
        """The first rollback that fired after `t` (time.time())."""
        return next((r for r in self.rollbacks if r["at"] >= t), None)

    def _run(self) -> None:
        seen: set[float] = set()
        while not self._stop.wait(self.poll_s):
            try:
                st = control.status(self.app)
            except Exception as e:  # noqa: BLE001 - a slow monitor is a figure, not the end
                self.errors.append(f"{time.time():.1f} {type(e).__name__}: {e}"[:300])
                continue
            self.last = st
            for rb in st.get("rollbacks") or []:
                if rb["at"] not in seen:
                    seen.add(rb["at"])
                    self.rollbacks.append(
                        {k: rb.get(k) for k in ("at", "reason", "detail", "weight_before")}
                    )
            now = {
                "weight": st["weight"],
                "rolled_back": st["rolled_back"],
                "custom_running": (st.get("replicas") or {}).get("custom", {}).get("running"),
            }
            if not self.snapshots or any(self.snapshots[-1][k] != v for k, v in now.items()):
                self.snapshots.append({"at": round(time.time(), 1), **now})

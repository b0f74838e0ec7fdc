"""The demo's own Ray cluster: started on 127.0.0.1 only, stopped with every process it started.

`LocalRay.start` starts one node with every server on 127.0.0.1 (`ray_compat.loopback_node`, and a
worker setup hook for the one server Ray Serve binds to every interface), its processes marked
by an environment variable they inherit. `LocalRay.stop` stops it as `ray stop` stops a
machine's clusters, but only its own processes: Serve first (the engines end their requests),
then Ray, then whatever of them is still alive (the agents ignore SIGTERM: SIGKILL after a
grace period), the metrics agent holding the export port included.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from . import ray_compat

# Every process the demo's Ray starts inherits this variable (value: the run's id).
MARKER_ENV = "FUSELANE_DEMO_CLUSTER"

# The demo's Ray starts every worker with this hook (`runtime_env.worker_process_setup_hook`).
LOOPBACK_SETUP_HOOK = f"{__name__}.replica_servers_on_loopback"


def replica_servers_on_loopback() -> None:
    """In a worker of the demo's cluster: a Serve replica's gRPC server for the calls of other
    deployments listens on 127.0.0.1, as every other server of the cluster does. Imports no
    more than ray_compat (which imports no Ray Serve LLM or vLLM): it runs in every worker."""
    ray_compat.replica_grpc_servers_on_loopback()


def marked(pid: int, run_id: str) -> bool:
    """Whether process `pid` carries the demo run's marker. Read from /proc as bytes: a process
    that set its title (`ray::DashboardAgent`) may have overwritten part of its environment
    block, where psutil stops reading at the first empty entry."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER_ENV}={run_id}\0".encode() in f.read() + b"\0"
    except OSError:
        return False  # gone, or another user's


class LocalRay:
    """The demo's Ray: one node on 127.0.0.1, started and stopped by this process."""

    def __init__(self) -> None:
        self.run_id = uuid.uuid4().hex
        self.address: str | None = None

    def start(self, **init_kwargs: Any) -> str:
        """`ray.init` a new cluster (its processes listen on 127.0.0.1 only and carry the
        marker); returns its address."""
        import ray

        os.environ[MARKER_ENV] = self.run_id  # inherited by the processes Ray starts
        try:
            with ray_compat.loopback_node():
                ctx = ray.init(
                    _node_ip_address="127.0.0.1",
                    logging_level="ERROR",
                    log_to_driver=False,
                    runtime_env={"worker_process_setup_hook": LOOPBACK_SETUP_HOOK},
                    **init_kwargs,
                )
        finally:
            os.environ.pop(MARKER_ENV, None)
        self.address = ctx.address_info["gcs_address"]
        return self.address

    def processes(self) -> list[Any]:
        """The live processes this cluster started: this process's descendants, and any that
        carry the marker but lost their parent (an engine whose replica was killed)."""
        import psutil

        found = {p.pid: p for p in psutil.Process().children(recursive=True)}
        for p in psutil.process_iter():
            if p.pid not in found and p.pid != os.getpid() and marked(p.pid, self.run_id):
                found[p.pid] = p
        return list(found.values())

    def stop(self, grace_s: float = 5.0) -> None:
        """Serve, then Ray, then every process of the cluster still alive (SIGTERM, SIGKILL
        after `grace_s`)."""
        import psutil
        import ray

        before = self.processes()
        if ray.is_initialized():
            from ray import serve

            try:
                serve.shutdown()  # Ray bounds it (30 s): the replicas stop their engines
            except Exception:  # noqa: BLE001 - Serve never started, or its controller is gone
                pass
            ray.shutdown()
        left = [p for p in {p.pid: p for p in [*before, *self.processes()]}.values()]
        for p in left:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=grace_s)

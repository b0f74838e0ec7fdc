"""The canary as Ray Serve applications.

Two layouts of the same deployments (`CanaryMonitor`, the arms `stock` and `custom` — Ray Serve
LLM's `LLMServer` — and the `CanaryIngress` in front):

- multi-app (what `fuselane canary deploy` applies, and `serve_config` writes for
  `serve deploy`): each arm is its own Serve application (`<name>-stock`, `<name>-custom`,
  no route) and the ingress with the monitor is `<name>`. An arm app's `args` hold only that
  arm's settings, so redeploying the custom arm (a new fuselane build, other kernel switches)
  restarts only the custom replicas — stock keeps serving and the ingress keeps routing — and a
  weight change (the ingress's `user_config`) restarts nothing;
- one app (`build_app(config)` for `serve.run` from Python, `app_builder` for
  `serve run fuselane.serving.canary.app:app_builder config_path=canary.yaml`): the same graph
  bound together; any change redeploys all of it.
"""

from __future__ import annotations

from typing import Any

from .config import CanaryConfig, load_config, parse_config

MODULE = "fuselane.serving.canary.app"
INGRESS = "CanaryIngress"


def arm_app_name(config: CanaryConfig, arm: str) -> str:
    return f"{config.name}-{arm}"


def arm_args(config: CanaryConfig, arm: str) -> dict[str, Any]:
    """Everything one arm's deployment depends on, and nothing else: in the multi-app layout
    these are the arm app's `args`, so a change elsewhere (the weight, the other arm) leaves
    this arm's replicas running."""
    spec = config.arm(arm)
    r = config.rollback
    return {
        "arm": arm,
        "monitor_app": config.name,
        "model_id": config.model.id,
        "model_source": config.model.source,
        "engine_kwargs": config.arm_engine_kwargs(arm),
        "env": config.arm_env(arm),
        "bundles": [dict(b) for b in spec.placement.bundles],
        "strategy": spec.placement.strategy,
        "replicas": spec.replicas,
        "replica_cpus": spec.replica_cpus,
        "max_ongoing_requests": spec.max_ongoing_requests,
        "checks": {
            "metric": r.check_metric,
            "result_label": r.check_result_label,
            "fail_values": list(r.check_fail_values),
        },
    }


def control_plane_options(config: CanaryConfig) -> dict[str, Any]:
    """Ray actor options of the ingress and the monitor: no CPU, and the resources the config
    names (multi-node: a stock node's, so that losing a custom node leaves them up)."""
    return {"num_cpus": 0, "resources": dict(config.ingress.resources)}


def ingress_deployment(config: CanaryConfig) -> Any:
    """The ingress as a Serve deployment (a fresh FastAPI app each call: no import-time state).
    Completions and chat take the raw request: the ingress reads the body itself
    (`router.read_body`), so that a body not sent as JSON gets a 4xx, not FastAPI's bytes."""
    from ray import serve
    from ray.serve.llm.ingress import make_fastapi_ingress

    from .ray_compat import DEFAULT_ENDPOINTS
    from .router import CanaryIngress

    endpoints = {
        "models": DEFAULT_ENDPOINTS["models"],
        "model_data": DEFAULT_ENDPOINTS["model_data"],
        "completions": DEFAULT_ENDPOINTS["completions"],
        "chat": DEFAULT_ENDPOINTS["chat"],
        "canary_status": lambda app: app.get("/canary/status"),
    }
    cls = make_fastapi_ingress(CanaryIngress, endpoint_map=endpoints)
    return serve.deployment(
        cls,
        name=INGRESS,
        num_replicas=config.ingress.replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options=control_plane_options(config),
        user_config=config.user_config(),
    )


def build_app(config: CanaryConfig) -> Any:
    """The whole canary as one Serve application (`ray.serve.Application`)."""
    from .engine import build_arm
    from .monitor import CanaryMonitor

    data = config.model_dump(mode="json")
    monitor = CanaryMonitor.options(ray_actor_options=control_plane_options(config)).bind(data)
    stock = build_arm(arm_args(config, "stock"), monitor)
    custom = build_arm(arm_args(config, "custom"), monitor)
    return ingress_deployment(config).bind(stock, custom, monitor, data)


def _config_from_args(args: dict[str, Any]) -> CanaryConfig:
    if "config" in args:
        return parse_config(args["config"], "args.config")
    if "config_path" in args:
        return load_config(args["config_path"], check_paths=False)
    raise ValueError("app builder args: expected 'config' (a mapping) or 'config_path' (a file)")


def app_builder(args: dict[str, Any]) -> Any:
    """One-app builder for Serve: `args` = `{"config": {...}}` or `{"config_path": PATH}`."""
    return build_app(_config_from_args(args))


def arm_builder(args: dict[str, Any]) -> Any:
    """Multi-app builder of one arm: `args` = `arm_args(config, arm)`."""
    from .engine import build_arm

    return build_arm(args)


def ingress_builder(args: dict[str, Any]) -> Any:
    """Multi-app builder of the ingress and the monitor: `args` = `{"config": {...}}`."""
    from .monitor import CanaryMonitor

    config = _config_from_args(args)
    data = config.model_dump(mode="json")
    monitor = CanaryMonitor.options(ray_actor_options=control_plane_options(config)).bind(data)
    return ingress_deployment(config).bind(
        arm_app_name(config, "stock"), arm_app_name(config, "custom"), monitor, data
    )


def ingress_config(config: CanaryConfig) -> dict[str, Any]:
    """The config as the ingress app's `args`: without the arms' settings (their own apps
    have them), so changing an arm does not restart the ingress and the monitor."""
    data = config.model_dump(mode="json", exclude={"arms", "env"})
    data["engine"] = {k: v for k, v in data["engine"].items() if k == "max_model_len"}
    return data


def serve_apps(config: CanaryConfig, user_config: dict[str, Any] | None = None) -> list[dict]:
    """The `applications:` entries of the multi-app layout, with the ingress's `user_config`
    (weight, shadow fraction, epoch) as a deployment override."""
    apps: list[dict[str, Any]] = [
        {
            "name": arm_app_name(config, arm),
            "route_prefix": None,
            "import_path": f"{MODULE}:arm_builder",
            "args": arm_args(config, arm),
        }
        for arm in ("stock", "custom")
    ]
    apps.append(
        {
            "name": config.name,
            "route_prefix": config.route_prefix,
            "import_path": f"{MODULE}:ingress_builder",
            "args": {"config": ingress_config(config)},
            "deployments": [{"name": INGRESS, "user_config": user_config or config.user_config()}],
        }
    )
    return apps


def serve_config(config: CanaryConfig) -> dict[str, Any]:
    """A complete Serve config file (for `serve deploy` / `serve run`) of the multi-app layout."""
    return {
        "http_options": {"host": config.http.host, "port": config.http.port},
        "applications": serve_apps(config),
    }

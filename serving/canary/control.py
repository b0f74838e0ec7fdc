"""Operating a canary on a running Ray cluster: deploy, reweight, read status.

These do what `serve run CONFIG` / `serve deploy CONFIG` do (apply a declarative Serve config
through the Serve controller), so that the weight can later change in place: a new `user_config`
for the ingress under the same code version reconfigures the ingress replicas live, with no
engine restart and no dropped request. The dashboard is not needed (the controller is reached
through Ray itself, as `serve run` does).
"""

from __future__ import annotations

import re
import time
from typing import Any

from . import ray_compat
from .app import INGRESS, arm_app_name, serve_apps
from .config import CanaryConfig

MONITOR = "CanaryMonitor"


class CanaryControlError(RuntimeError):
    pass


def _client(http: dict[str, Any] | None = None) -> Any:
    return ray_compat.serve_client(http)


def _declarative_apps(client: Any, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The apps deployed from config now, but `skip` (a config apply replaces the whole set,
    so other people's apps are sent back unchanged)."""
    details = client.get_serve_details()
    apps = []
    for name, app in (details.get("applications") or {}).items():
        cfg = app.get("deployed_app_config")
        if cfg and name not in skip:
            apps.append(cfg)
    return apps


def _names(config: CanaryConfig) -> tuple[str, ...]:
    return (config.name, arm_app_name(config, "stock"), arm_app_name(config, "custom"))


def _apply(client: Any, apps: list[dict[str, Any]], http: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate({"http_options": http, "applications": apps})
    client.deploy_apps(schema)


def deploy_user_config(
    config: CanaryConfig, live: dict[str, Any] | None, *, weight_from_file: bool = False
) -> tuple[dict[str, Any], str]:
    """The ingress's user_config for a deploy, and a line saying which weight it uses.

    A redeploy keeps the running canary's weight and shadow fraction (an operator may have moved
    them with `fuselane canary weight` since the file was written) unless `weight_from_file`;
    the epoch is always the live one: redeploying is not the operator's acknowledgement of a
    rollback (`fuselane canary weight` is)."""
    from_file = config.user_config()
    if live is None:
        return from_file, f"weight {from_file['weight']:g} (from the file: a new deployment)"
    chosen = (
        dict(from_file)
        if weight_from_file
        else dict(from_file)
        | {
            "weight": float(live.get("weight", from_file["weight"])),
            "shadow_fraction": float(live.get("shadow_fraction", from_file["shadow_fraction"])),
        }
    )
    chosen["epoch"] = int(live.get("epoch", 0))
    if weight_from_file:
        note = f"from the file, as asked; the running canary had {live.get('weight', 0.0):g}"
    else:
        note = f"kept from the running canary; the file says {from_file['weight']:g}, "
        note += "--weight-from-file applies it"
    return (
        chosen,
        f"weight {chosen['weight']:g}, shadow fraction {chosen['shadow_fraction']:g} ({note})",
    )


def deploy(
    config: CanaryConfig,
    *,
    wait_s: float = 900.0,
    poll_s: float = 2.0,
    weight_from_file: bool = False,
) -> str:
    """Start Serve's HTTP proxy on the config's host/port if needed, apply the app, wait until
    it is RUNNING (raise CanaryControlError with Serve's message if it fails or times out).
    Returns the line saying which weight the deployment uses (`deploy_user_config`).

    An app whose update fails gets its previous config back: Serve stops an arm's old replicas
    before it starts the new ones (a one-replica arm has none left), so without it the arm
    would stay down until the next deploy. The error says whether the previous one runs again."""
    http = {"host": config.http.host, "port": config.http.port}
    client = _client(http)
    live = None
    try:
        live = current_user_config(config.name)[1]
    except CanaryControlError:
        pass
    user_config, weight_line = deploy_user_config(config, live, weight_from_file=weight_from_file)
    apps = _declarative_apps(client, skip=_names(config))
    previous = {a["name"]: a for a in _declarative_apps(client) if a["name"] in _names(config)}
    _apply(client, [*apps, *serve_apps(config, user_config)], http)
    if wait_s > 0:
        try:
            for name in _names(config):
                wait_running(name, wait_s=wait_s, poll_s=poll_s)
        except DeployFailed as e:
            restored = _restore(previous.get(e.app), e.app, http, wait_s)
            raise DeployFailed(e.app, f"{e}\n{restored}") from None
    return weight_line


class DeployFailed(CanaryControlError):
    def __init__(self, app: str, message: str) -> None:
        super().__init__(message)
        self.app = app


def _restore(previous: dict[str, Any] | None, app: str, http: dict[str, Any], wait_s: float) -> str:
    if previous is None:
        return f"{app!r} had no earlier deployment to go back to"
    client = _client()
    _apply(client, [*_declarative_apps(client, skip=(app,)), previous], http)
    try:
        wait_running(app, wait_s=wait_s)
    except CanaryControlError as e:
        return f"the previous {app!r} is deployed again but does not run: {e}"
    return f"the previous {app!r} is deployed again and running"


# The last line of a Python traceback: `ValueError: ...`, `ray.exceptions.RayTaskError(...): ...`
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b[^:]*:")


def replica_error(message: str) -> str:
    """A deployment's status message down to the replica's own error: Serve's first sentence
    and the traceback's last exception line (with the lines of its message)."""
    head, _, trace = message.partition("Error:\n")
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip()]
    last = max((i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)), default=None)
    if last is None:
        return message.strip()
    return f"{head.split('. ')[0].strip()}: {' '.join(lines[last:])}"


def wait_running(app: str, *, wait_s: float = 900.0, poll_s: float = 2.0) -> None:
    client = _client()
    deadline = time.monotonic() + wait_s
    last = ""
    while time.monotonic() < deadline:
        status = client.get_serve_status(app)
        state = str(status.app_status.status)
        if state.endswith("RUNNING"):
            return
        if state.endswith("DEPLOY_FAILED") or state.endswith("UNHEALTHY"):
            failed = [
                f"\n  {d.name}: {replica_error(d.message)}"
                for d in status.deployment_statuses
                if str(d.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")) and d.message
            ]
            msg = f"app {app!r}: {state}: {status.app_status.message}{''.join(failed)}"
            raise DeployFailed(app, msg)
        last = f"{state} {status.app_status.message}".strip()
        time.sleep(poll_s)
    raise CanaryControlError(f"app {app!r} not running after {wait_s:g}s: {last}")


def current_user_config(app: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the app's Serve config, the ingress's user_config in force)."""
    client = _client()
    details = client.get_serve_details()
    entry = (details.get("applications") or {}).get(app)
    if entry is None:
        raise CanaryControlError(f"no Serve application {app!r} on this cluster")
    cfg = entry.get("deployed_app_config")
    if not cfg:
        raise CanaryControlError(
            f"app {app!r} was not deployed from a config (serve.run from Python?): its weight "
            f"cannot change live; deploy it with `fuselane canary deploy CONFIG`"
        )
    for d in cfg.get("deployments") or []:
        if d.get("name") == INGRESS and d.get("user_config") is not None:
            return cfg, dict(d["user_config"])
    return cfg, dict(CanaryConfig.model_validate(cfg["args"]["config"]).user_config())


def set_weight(app: str, weight: float, shadow_fraction: float | None = None) -> dict[str, Any]:
    """Set the custom arm's weight live; this is the operator's action that clears a rollback
    (the epoch goes up). Returns the new user_config."""
    if not 0.0 <= weight <= 1.0:
        raise CanaryControlError(f"weight: must be between 0 and 1, got {weight}")
    if shadow_fraction is not None and not 0.0 <= shadow_fraction <= 1.0:
        raise CanaryControlError(f"shadow fraction: must be between 0 and 1, got {shadow_fraction}")
    client = _client()
    cfg, user_config = current_user_config(app)
    user_config = {
        **user_config,
        "weight": weight,
        "epoch": int(user_config.get("epoch", 0)) + 1,
    }
    if shadow_fraction is not None:
        user_config["shadow_fraction"] = shadow_fraction
    deployments = [d for d in (cfg.get("deployments") or []) if d.get("name") != INGRESS]
    deployments.append({"name": INGRESS, "user_config": user_config})
    new_cfg = {**cfg, "deployments": deployments}
    http = client.get_serve_details().get("http_options") or {}
    apps = [*_declarative_apps(client, skip=(app,)), new_cfg]
    _apply(client, apps, {k: http[k] for k in ("host", "port") if k in http})
    return user_config


def status(app: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The monitor's status dictionary (see `CanaryMonitor.status`), with each arm's replicas
    as Serve sees them (`replicas`)."""
    from ray import serve

    handle = serve.get_deployment_handle(MONITOR, app_name=app)
    st = handle.status.remote().result(timeout_s=timeout_s)
    st["replicas"] = arm_replicas(app)
    return st


def _value(v: Any) -> str:
    return str(getattr(v, "value", v))


def arm_replicas(app: str) -> dict[str, dict[str, Any]]:
    """Per arm: Serve's deployment status, replicas running out of those wanted, their nodes.
    The monitor sees outcomes only: an arm whose node is gone looks idle there, not down."""
    apps = _client().get_serve_details().get("applications") or {}
    out: dict[str, dict[str, Any]] = {}
    for arm in ("stock", "custom"):
        # Multi-app layout: the arm's own app; one-app layout: a deployment of `app`.
        entry = apps.get(f"{app}-{arm}") or apps.get(app) or {}
        dep = (entry.get("deployments") or {}).get(arm)
        if dep is None:
            out[arm] = {"status": "NOT_DEPLOYED", "running": 0, "target": 0, "nodes": []}
            continue
        running = [r for r in dep.get("replicas") or [] if _value(r.get("state")) == "RUNNING"]
        out[arm] = {
            "status": _value(dep.get("status")),
            "running": len(running),
            "target": dep.get("target_num_replicas") or 0,
            "nodes": sorted({r.get("node_id") for r in running if r.get("node_id")}),
        }
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def format_status(st: dict[str, Any]) -> str:
    """A readable table of a status dictionary."""
    lines = [
        f"app {st['app']}  model {st['model']}  "
        f"weight {st['weight']:.3f} (operator {st['operator_weight']:.3f})  "
        f"shadow fraction {st['shadow_fraction']:.3f}  epoch {st['epoch']}",
    ]
    rb = st.get("rollback")
    if rb:
        when = time.strftime("%H:%M:%S", time.localtime(rb["at"]))
        lines.append(
            f"ROLLED BACK at {when}: {rb['reason']}: {rb['detail']} "
            f"(weight was {rb['weight_before']:g}; `fuselane canary weight W` sets it back)"
        )
    lines.append("")
    head = f"{'arm':<8}{'requests':>10}{'share':>8}{'ok':>8}{'errors':>8}{'cut':>6}{'4xx':>6}"
    head += f"{'err% win':>10}{'p50 ms':>9}{'p95 ms':>9}"
    lines.append(head)
    for arm in ("stock", "custom"):
        a = st["arms"][arm]
        lines.append(
            f"{arm:<8}{a['requests']:>10}{a['traffic_share'] * 100:>7.1f}%{a['ok']:>8}"
            f"{a['errors']:>8}{a.get('streams_cut', 0):>6}{a['client_errors']:>6}"
            f"{a['error_rate_window'] * 100:>9.1f}%"
            f"{_ms(a['latency_p50_s']):>9}{_ms(a['latency_p95_s']):>9}"
        )
    lines.append("(cut: streams that failed after their first chunk, also among the errors)")
    reps = st.get("replicas") or {}
    if reps:
        lines.append(
            "replicas running: "
            + "; ".join(
                f"{arm} {r['running']}/{r['target']} ({r['status']})"
                + (" DOWN" if r["target"] and not r["running"] else "")
                for arm, r in reps.items()
            )
        )
    fo = st.get("failovers") or {}
    lines.append("")
    lines.append(
        "failovers to stock: "
        + (", ".join(f"{k} {v}" for k, v in sorted(fo.items())) if fo else "none")
    )
    sh = st["shadow"]
    mean = sh.get("agreement_mean_window")
    lines.append(
        f"shadow: {sh['compared']} compared, {sh['exact']} identical, {sh['errors']} failed; "
        f"mean agreement {'-' if mean is None else f'{mean:.3f}'}; "
        f"max |logprob diff| {sh['max_logprob_diff']:.2e}"
    )
    if sh["errors"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted((sh.get("error_types") or {}).items()))
        lines.append(f"  failed pairs: {kinds}; last: {sh.get('last_error')}")
    rule = st.get("latency_rule") or {}
    if rule.get("custom_interpreted"):
        ratio = rule.get("max_ratio")
        lines.append(
            "latency rule: custom's kernels run under Triton's interpreter: "
            + ("off" if ratio is None else f"ratio {ratio:g}")
        )
    kc = st["kernel_checks"]
    lines.append(
        f"numerical-check failures on custom since the last operator action: "
        f"{kc['failed_since_reset']}"
    )
    rbs = st.get("rollbacks") or []
    lines.append(f"rollbacks: {len(rbs)}")
    for r in rbs[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(r["at"]))
        lines.append(f"  {when} {r['reason']}: {r['detail']}")
    return "\n".join(lines)


def format_kernel_metrics(st: dict[str, Any]) -> str:
    """Per-kernel metrics as reported by the arms' replicas (summed per arm)."""
    per_arm: dict[str, dict[tuple, float]] = {}
    for rep in (st.get("kernel_metrics") or {}).values():
        if not rep["samples"]:
            continue
        acc = per_arm.setdefault(rep["arm"], {})
        for s in rep["samples"]:
            key = (s["name"], tuple(sorted(s["labels"].items())))
            acc[key] = acc.get(key, 0.0) + s["value"]
    if not per_arm:
        return (
            "no fuselane kernel metrics reported: telemetry is off (FUSELANE_TELEMETRY), or no "
            "fuselane kernel ran in the arms' engines"
        )
    lines = []
    for arm in sorted(per_arm):
        lines.append(f"[{arm}]")
        for (name, labels), value in sorted(per_arm[arm].items()):
            lab = ",".join(f"{k}={v}" for k, v in labels)
            lines.append(f"  {name}{{{lab}}} {value:g}")
    return "\n".join(lines)

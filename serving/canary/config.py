"""The canary's YAML schema, loading, and one clear error per bad field.

A config names the model once, the two arms (`stock`: vLLM's own kernels; `custom`: fuselane's,
switched on through the arm's environment), and the routing, shadow, failover and rollback
policies. `serving/configs/*.yaml` are complete examples. Every error names the field by its
dotted path (`routing.weight`, `arms.canary`, `model.source`) with what was expected and what
was given, all errors at once.

Strict throughout: no key twice, no boolean where a number is expected (`weight: true` is not
1.0), no threshold that its window can never reach, the arms' fuselane variables parsed by the
plugin's own parsers (`config_checks.py`). `load_config` also has vLLM's parser read the engine
arguments; it is the only place that imports vLLM, when the CLI validates a file before it
contacts a cluster. Nothing here imports Ray.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fuselane.plugin.config import CHECK_INDICES_ENV_VAR as CHECK_INDICES_ENV
from fuselane.plugin.config import ENV_VAR as KERNELS_ENV
from fuselane.plugin.config import host_problem

from . import config_checks
from .config_checks import ARMS, ENGINE_KEYS_FROM_MODEL, DuplicateKeyError

log = logging.getLogger(__name__)


class CanaryConfigError(ValueError):
    """A config that cannot be deployed; the message lists every bad field."""


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelt `wieght` must not silently keep the default. Strict
    # types: YAML's `true` is no number and `2.0` no integer (an int is still a float).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(_Strict):
    """The model both arms serve."""

    id: str = Field(min_length=1, description="served name: the OpenAI `model` field")
    source: str = Field(min_length=1, description="local directory or Hugging Face id")


class PlacementSpec(_Strict):
    """Ray placement group of one replica's engine: one bundle per engine worker (TP x PP).

    Arms are placed by resources: `{"GPU": 1, "custom_arm": 1}` pins the custom arm's engines to
    nodes started with `ray start --resources '{"custom_arm": 4}'`.
    """

    bundles: list[dict[str, float]] = Field(default_factory=lambda: [{"CPU": 1.0}], min_length=1)
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"


class ArmSpec(_Strict):
    replicas: int = Field(1, ge=1)
    env: dict[str, str] = Field(default_factory=dict, description="env vars of the replicas")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments, over the shared `engine`"
    )
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    replica_cpus: float = Field(1.0, ge=0, description="CPUs of the replica actor itself")
    max_ongoing_requests: int = Field(64, ge=1)
    check_indices: bool = Field(
        False,
        description="FUSELANE_CHECK_INDICES=1 in the replicas: every kernel call checks its "
        "device-side indices first (one host sync per call: for a canary that must fail loudly "
        "rather than read out of bounds, at some cost in speed)",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        return _env_strings(v)


def _env_strings(v: Any) -> Any:
    """YAML reads `FUSELANE_TELEMETRY: 1` as an int and `on` as a bool; env values are strings.
    Anything else (a list, a mapping) is left to fail the str check with the field named."""
    if not isinstance(v, dict):
        return v
    out = {}
    for key, val in v.items():
        if isinstance(val, bool):
            val = "1" if val else "0"
        elif isinstance(val, int | float):
            val = str(val)
        out[key] = val
    return out


class ArmsSpec(_Strict):
    # Each arm's environment is checked as a whole (shared `env` under the arm's) by
    # CanaryConfig: a FUSELANE_KERNELS in the shared `env` reaches the stock arm too.
    stock: ArmSpec = Field(default_factory=lambda: ArmSpec(env={KERNELS_ENV: "none"}))
    custom: ArmSpec = Field(default_factory=lambda: ArmSpec(env={KERNELS_ENV: "all"}))


class RoutingSpec(_Strict):
    weight: float = Field(0.0, ge=0.0, le=1.0, description="fraction of traffic to custom")
    session_header: str = Field("x-session-id", min_length=1)
    use_user_field: bool = Field(True, description="the OpenAI `user` field is a sticky key")
    pin_header: str = Field("x-fuselane-arm", min_length=1)
    allow_pin_custom: bool = Field(
        False, description="whether `pin_header: custom` may pin a request to the custom arm"
    )


class ShadowSpec(_Strict):
    fraction: float = Field(0.0, ge=0.0, le=1.0, description="fraction mirrored to both arms")
    max_tokens: int = Field(32, ge=1, description="cap on a mirrored request's max_tokens")
    max_in_flight: int = Field(4, ge=1, description="mirrored pairs running at once (per replica)")


class FailoverSpec(_Strict):
    first_response_timeout_s: float = Field(60.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0, description="custom traffic diverted after a death")


class RollbackSpec(_Strict):
    """The rules of `rollback.py`. A rule whose threshold is null is off (`max_latency_ratio:
    null`: latency never rolls back); `enabled: false` turns them all off. A threshold that its
    window can never reach is refused: it would switch its rule off without a word."""

    enabled: bool = True
    window: int = Field(200, ge=1, description="most recent outcomes per arm kept")
    window_s: float | None = Field(
        600.0, gt=0, description="outcomes older than this (s) leave the windows; null: none"
    )
    min_requests: int = Field(20, ge=1, description="custom outcomes before rates are judged")
    max_error_rate: float = Field(0.05, ge=0.0, le=1.0)
    max_outage_s: float | None = Field(
        600.0,
        gt=0,
        description="custom answering nothing this long after a death or hang rolls it back "
        "(a crash loop, an arm that never comes back); null: off",
    )
    max_latency_ratio: float | None = Field(
        3.0, gt=0, description="custom p50 / stock p50, compiled kernels; null: rule off"
    )
    max_latency_ratio_interpreted: float | None = Field(
        None, gt=0, description="the same while custom's kernels run interpreted; null: rule off"
    )
    min_agreement: float | None = Field(0.98, ge=0.0, le=1.0)
    min_shadow_samples: int = Field(10, ge=1)
    max_numerical_check_failures: int | None = Field(0, ge=0)
    check_metric: str = Field("fuselane_numerical_checks", min_length=1)
    check_result_label: str = Field("result", min_length=1)
    check_fail_values: list[str] = Field(default_factory=lambda: ["fail"], min_length=1)

    @model_validator(mode="after")
    def _reachable(self) -> RollbackSpec:
        errors = []
        # The rules judge only once this many outcomes are in a window of `window` (rollback.py:
        # the error-rate and latency rules count custom / both arms' outcomes, the agreement
        # rule mirrored pairs): a minimum above the window is never met.
        for name, rules in (
            ("min_requests", "the error-rate and latency rules"),
            ("min_shadow_samples", "the agreement rule"),
        ):
            value = getattr(self, name)
            if value > self.window:
                errors.append(
                    f"rollback.{name}: {value} is above rollback.window ({self.window}), "
                    f"which keeps that many outcomes, so {rules} would never judge; expected "
                    f"at most {self.window}"
                )
        if self.max_error_rate >= 1.0:
            errors.append(
                f"rollback.max_error_rate: {self.max_error_rate:g} can never be exceeded (the "
                f"rule fires above it); expected below 1 (rollback.enabled: false turns "
                f"rollback off)"
            )
        # custom p50 / stock p50 above the ratio rolls back: below 1, an arm exactly as fast
        # as stock (or faster, up to the ratio) is rolled back, which no operator means.
        for name in ("max_latency_ratio", "max_latency_ratio_interpreted"):
            ratio = getattr(self, name)
            if ratio is not None and ratio < 1.0:
                errors.append(
                    f"rollback.{name}: {ratio:g} would roll back a custom arm as fast as stock "
                    f"(the rule fires when custom's p50 latency is above {ratio:g} x stock's); "
                    f"expected at least 1, or null to switch the rule off"
                )
        if self.min_agreement is not None and self.min_agreement <= 0.0:
            errors.append(
                f"rollback.min_agreement: {self.min_agreement:g} can never be undercut (the "
                f"rule fires below it); expected above 0, or null to switch the rule off"
            )
        if errors:
            raise ValueError("\n  ".join(errors))
        return self


class HttpSpec(_Strict):
    # Another host than a loopback one is accepted with a warning (load_config).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        problem = host_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v


class IngressSpec(_Strict):
    replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(256, ge=1)
    # The ingress and the monitor take no CPU, so Serve may place them on any node, a custom
    # arm's too: losing that node would take routing and the rollback state down with it.
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources of the ingress and monitor replicas: {stock_arm: 0.01}",
    )

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [f"{k}: {x:g}" for k, x in v.items() if k in ("CPU", "GPU") or x <= 0]
        if bad:
            raise ValueError(
                f"expected custom resources with amounts above 0 (not CPU or GPU), got "
                f"{', '.join(bad)}"
            )
        return v


class CanaryConfig(_Strict):
    name: str = Field("fuselane-canary", min_length=1, description="Serve application name")
    route_prefix: str = "/"
    http: HttpSpec = Field(default_factory=HttpSpec)
    model: ModelSpec
    engine: dict[str, Any] = Field(default_factory=dict, description="vLLM args of both arms")
    env: dict[str, str] = Field(default_factory=dict, description="env vars of both arms")
    arms: ArmsSpec = Field(default_factory=ArmsSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    shadow: ShadowSpec = Field(default_factory=ShadowSpec)
    failover: FailoverSpec = Field(default_factory=FailoverSpec)
    rollback: RollbackSpec = Field(default_factory=RollbackSpec)
    ingress: IngressSpec = Field(default_factory=IngressSpec)

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        return _env_strings(v)

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must start with '/', got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        problem = config_checks.name_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _arms(self) -> CanaryConfig:
        """Across fields: the engine arguments Ray Serve LLM sets itself, and each arm's
        environment as its engines will read it."""
        errors = [
            f"{where}.{key}: set from model.id / model.source; Ray Serve LLM refuses it here"
            for where, engine in (
                ("engine", self.engine),
                ("arms.stock.engine", self.arms.stock.engine),
                ("arms.custom.engine", self.arms.custom.engine),
            )
            for key in ENGINE_KEYS_FROM_MODEL
            if key in engine
        ]
        errors += config_checks.env_errors(self)
        errors += config_checks.outage_errors(self)
        if errors:
            raise ValueError("\n  ".join(errors))
        return self

    def arm(self, name: str) -> ArmSpec:
        return getattr(self.arms, name)

    def arm_env(self, name: str) -> dict[str, str]:
        """The arm's environment: shared `env`, then the arm's; the kernel switch always set."""
        arm = self.arm(name)
        env = {**self.env, **arm.env}
        env.setdefault(KERNELS_ENV, "none" if name == "stock" else "all")
        if arm.check_indices:
            env[CHECK_INDICES_ENV] = "1"
        return env

    def arm_engine_kwargs(self, name: str) -> dict[str, Any]:
        return {**self.engine, **self.arm(name).engine}

    def user_config(self, epoch: int = 0) -> dict[str, Any]:
        """The ingress's Serve `user_config`: what changes live, without a restart."""
        return {
            "weight": self.routing.weight,
            "shadow_fraction": self.shadow.fraction,
            "epoch": epoch,
        }


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _describe(err: dict[str, Any]) -> str:
    loc = err["loc"]
    where = _loc(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        if len(loc) == 2 and loc[0] == "arms":
            return f"{where}: unknown arm {loc[1]!r}; the arms are {', '.join(ARMS)}"
        return f"{where}: unknown field"
    if kind == "missing":
        return f"{where}: required field missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        # Validators that span fields name the exact field themselves.
        if not loc or msg.split(":", 1)[0].startswith(where):
            return msg
        return f"{where}: {msg}"
    given = err.get("input")
    return f"{where}: {msg} (got {given!r})"


def parse_config(data: Any, source: str = "config") -> CanaryConfig:
    """Validate a mapping (the YAML's content); raise CanaryConfigError listing every bad field."""
    if not isinstance(data, dict):
        raise CanaryConfigError(f"{source}: expected a mapping at the top level, got {data!r}")
    try:
        return CanaryConfig.model_validate(data)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise CanaryConfigError(
            f"{source}: invalid canary config:\n  " + "\n  ".join(lines)
        ) from None


def load_config(
    path: str | Path, *, check_paths: bool = True, check_engine: bool = True
) -> CanaryConfig:
    """Read and validate a YAML config; log a warning for what is allowed but likely unintended.
    `check_paths`: a `model.source` that is a local path must exist here (skip it when the model
    lives only on the cluster's nodes). `check_engine`: vLLM's own parser reads the engine
    arguments (imports vLLM: seconds; skipped with a warning where vLLM is not installed)."""
    p = Path(path)
    try:
        data = config_checks.load_yaml(p.read_text())
    except OSError as e:
        raise CanaryConfigError(f"{p}: cannot read the config: {e.strerror}") from None
    except DuplicateKeyError as e:
        raise CanaryConfigError(
            f"{p}: {e}; a mapping takes each key once (YAML would keep the last silently)"
        ) from None
    except yaml.YAMLError as e:
        raise CanaryConfigError(f"{p}: not valid YAML: {e}") from None
    config = parse_config(data, str(p))
    if check_engine:
        check_engine_args(config, str(p))
    for warning in config_checks.config_warnings(config):
        log.warning("%s: %s", p, warning)
    src = config.model.source
    if src.startswith(("./", "../", "~")):
        # Replicas run elsewhere (another working directory, another node): send them an
        # absolute path, resolved where the command runs.
        absolute = str(Path(src).expanduser().resolve())
        config = config.model_copy(update={"model": ModelSpec(id=config.model.id, source=absolute)})
    if check_paths:
        check_model_path(config, str(p))
    return config


def check_engine_args(config: CanaryConfig, source: str = "config") -> None:
    """vLLM's own parser reads each arm's engine arguments (imports vLLM: seconds); raise
    CanaryConfigError listing every bad one."""
    errors = config_checks.engine_errors(config)
    if errors:
        raise CanaryConfigError(f"{source}: invalid canary config:\n  " + "\n  ".join(errors))


def looks_like_path(source: str) -> bool:
    """Absolute, ./ or ../ relative, ~, or an existing relative path (else a hub id)."""
    if source.startswith(("/", "./", "../", "~")):
        return True
    return os.sep in source and Path(source).exists()


def check_model_path(config: CanaryConfig, source: str = "config") -> None:
    """A local `model.source` must be a directory with a `config.json`."""
    src = config.model.source
    if not looks_like_path(src):
        return
    d = Path(src).expanduser()
    if not d.is_dir():
        raise CanaryConfigError(f"{source}: model.source: no such directory {src!r}")
    if not (d / "config.json").is_file():
        raise CanaryConfigError(f"{source}: model.source: {src!r} has no config.json")

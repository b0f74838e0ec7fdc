"""The canary's YAML schema, loading, and one clear error per bad field.

A config names the model once, the two arms (`stock`: vLLM's own kernels; `custom`: fuselane's,
switched on through the arm's environment), and the routing, shadow, failover and rollback
policies. `serving/configs/*.yaml` are complete examples. Every error names the field by its
dotted path (`routing.weight`, `arms.canary`, `model.source`) with what was expected and what
was given, all errors at once.

Nothing here imports Ray or vLLM: the CLI validates a file before it contacts a cluster.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ARMS = ("stock", "custom")
KERNELS_ENV = "FUSELANE_KERNELS"  # fuselane.plugin.config.ENV_VAR (names only: no plugin import)


class CanaryConfigError(ValueError):
    """A config that cannot be deployed; the message lists every bad field."""


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelt `wieght` must not silently keep the default.
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    stock: ArmSpec = Field(default_factory=lambda: ArmSpec(env={KERNELS_ENV: "none"}))
    custom: ArmSpec = Field(default_factory=lambda: ArmSpec(env={KERNELS_ENV: "all"}))

    @model_validator(mode="after")
    def _kernels(self) -> ArmsSpec:
        stock_kernels = self.stock.env.get(KERNELS_ENV, "none").strip().lower()
        if stock_kernels not in ("", "none"):
            raise ValueError(
                f"arms.stock.env.{KERNELS_ENV}: the stock arm runs vLLM's own kernels; "
                f"expected 'none' or unset, got {stock_kernels!r}"
            )
        return self


class RoutingSpec(_Strict):
    weight: float = Field(0.0, ge=0.0, le=1.0, description="fraction of traffic to custom")
    session_header: str = Field("x-session-id", min_length=1)
    use_user_field: bool = Field(True, description="the OpenAI `user` field is a sticky key")
    pin_header: str = Field("x-fuselane-arm", min_length=1)


class ShadowSpec(_Strict):
    fraction: float = Field(0.0, ge=0.0, le=1.0, description="fraction mirrored to both arms")
    max_tokens: int = Field(32, ge=1, description="cap on a mirrored request's max_tokens")
    max_in_flight: int = Field(4, ge=1, description="mirrored pairs running at once (per replica)")


class FailoverSpec(_Strict):
    first_response_timeout_s: float = Field(60.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0, description="custom traffic diverted after a death")


class RollbackSpec(_Strict):
    enabled: bool = True
    window: int = Field(200, ge=1, description="most recent outcomes per arm kept")
    min_requests: int = Field(20, ge=1, description="custom outcomes before rates are judged")
    max_error_rate: float = Field(0.05, ge=0.0, le=1.0)
    max_latency_ratio: float | None = Field(3.0, gt=0, description="custom p50 / stock p50")
    min_agreement: float | None = Field(0.98, ge=0.0, le=1.0)
    min_shadow_samples: int = Field(10, ge=1)
    max_numerical_check_failures: int | None = Field(0, ge=0)
    check_metric: str = Field("fuselane_numerical_checks", min_length=1)
    check_result_label: str = Field("result", min_length=1)
    check_fail_values: list[str] = Field(default_factory=lambda: ["fail"], min_length=1)


class HttpSpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)


class IngressSpec(_Strict):
    replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(256, ge=1)


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

    def arm(self, name: str) -> ArmSpec:
        return getattr(self.arms, name)

    def arm_env(self, name: str) -> dict[str, str]:
        """The arm's environment: shared `env`, then the arm's; the kernel switch always set."""
        env = {**self.env, **self.arm(name).env}
        env.setdefault(KERNELS_ENV, "none" if name == "stock" else "all")
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
        if msg.split(":", 1)[0].startswith(where):
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


def load_config(path: str | Path, *, check_paths: bool = True) -> CanaryConfig:
    """Read and validate a YAML config. `check_paths`: a `model.source` that is a local path
    must exist here (skip it when the model lives only on the cluster's nodes)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise CanaryConfigError(f"{p}: cannot read the config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise CanaryConfigError(f"{p}: not valid YAML: {e}") from None
    config = parse_config(data, str(p))
    src = config.model.source
    if src.startswith(("./", "../", "~")):
        # Replicas run elsewhere (another working directory, another node): send them an
        # absolute path, resolved where the command runs.
        absolute = str(Path(src).expanduser().resolve())
        config = config.model_copy(update={"model": ModelSpec(id=config.model.id, source=absolute)})
    if check_paths:
        check_model_path(config, str(p))
    return config


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

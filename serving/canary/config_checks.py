"""The canary config's checks beyond one field's type and range.

- YAML read strictly: a key given twice in one mapping is an error naming the key (as a dotted
  path) and both lines (PyYAML keeps the last value without a word).
- The arms' environments validated by the plugin's own parsers (`FUSELANE_KERNELS`,
  `FUSELANE_FAULT_INJECT`, `FUSELANE_TELEMETRY*`), the ones each engine runs at start-up: a value
  the engine would refuse is refused here, before anything is deployed.
- The arms' engine arguments parsed by vLLM's own parser (`vllm serve`'s), through
  `fuselane.plugin.vllm_compat` (serving imports no vLLM itself). vLLM is imported only for
  this check, which `load_config` runs; without vLLM here it is skipped with a warning.
- Warnings for what is legal but likely unintended (an endpoint on every interface).

Nothing here imports the schema (`config.py` imports this module): the functions take the
config object and read its fields.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml

from fuselane.plugin.config import (
    CHECK_INDICES_ENV_VAR,
    FAULT_INJECT_ENV_VAR,
    HOPPER_ENV_VAR,
    FuselaneConfigError,
    is_loopback,
    parse_check_indices,
    parse_fault_inject,
    parse_hopper_kernels,
    parse_kernels,
)
from fuselane.plugin.config import ENV_VAR as KERNELS_ENV
from fuselane.plugin.telemetry_config import PORT_ENV, TelemetryConfig, TelemetryConfigError

if TYPE_CHECKING:
    import argparse

    from .config import CanaryConfig

log = logging.getLogger(__name__)

ARMS = ("stock", "custom")
# The Serve application names are `name` and `name-stock` / `name-custom`; they appear in Serve's
# REST paths, handles and metric tags, so they stay plain identifiers.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
NAME_EXPECTED = "letters, digits, '-' and '_', starting with a letter or digit, at most 63"
# Ray Serve LLM sets these from `model` (model_loading_config) and refuses them in engine_kwargs.
ENGINE_KEYS_FROM_MODEL = ("model", "served_model_name")


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that gives one key twice; `path` (dotted), `line` and `first_line` say where."""

    def __init__(self, path: str, line: int, first_line: int) -> None:
        super().__init__(f"line {line}: duplicate key {path} (first given at line {first_line})")
        self.path, self.line, self.first_line = path, line, first_line


def _unique_keys(node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> None:
    """Walk the composed document; raise DuplicateKeyError at a mapping's second same key.
    Keys compare as YAML resolved them (tag and text: `1` and `"1"` differ). Merge keys (`<<`)
    are skipped: what they bring in may be overridden, as YAML intends."""
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            name = str(key_node.value)
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, name)
                if key in first:
                    raise DuplicateKeyError(".".join((*path, name)), line, first[key])
                first[key] = line
            _unique_keys(value_node, (*path, name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _unique_keys(item, (*path, str(i)), seen)


def load_yaml(text: str) -> Any:
    """Parse YAML like `yaml.safe_load`, refusing duplicate keys (DuplicateKeyError): PyYAML
    itself keeps the last value without a word."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _unique_keys(node, (), set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------------------------
# Fields checked with the plugin's parsers
# ---------------------------------------------------------------------------------------------


def name_problem(name: str) -> str | None:
    """Why `name` cannot name the canary's Serve applications, or None."""
    if NAME_PATTERN.fullmatch(name):
        return None
    return f"expected {NAME_EXPECTED} characters, got {name!r}"


def _env_field(config: CanaryConfig, arm: str, variable: str) -> str:
    """The field that set `variable` in the arm's environment (the arm's own wins)."""
    return f"arms.{arm}.env.{variable}" if variable in config.arm(arm).env else f"env.{variable}"


def _arm_env_errors(config: CanaryConfig, arm: str) -> list[str]:
    env = config.arm_env(arm)
    errors: list[str] = []

    def bad(e: FuselaneConfigError | TelemetryConfigError) -> None:
        errors.append(f"{_env_field(config, arm, e.variable)}: {e}")

    try:
        selection = parse_kernels(env.get(KERNELS_ENV))
    except FuselaneConfigError as e:
        bad(e)
    else:
        if arm == "stock" and selection.families:
            field = _env_field(config, arm, KERNELS_ENV)
            where = "" if field.startswith("arms.") else " (set it in arms.custom.env)"
            errors.append(
                f"{field}: the stock arm runs vLLM's own kernels; expected 'none' or unset, "
                f"got {selection.raw!r}{where}"
            )
    try:
        parse_fault_inject(env.get(FAULT_INJECT_ENV_VAR))
    except FuselaneConfigError as e:
        bad(e)
    try:
        parse_check_indices(env.get(CHECK_INDICES_ENV_VAR))
    except FuselaneConfigError as e:
        bad(e)
    try:
        parse_hopper_kernels(env.get(HOPPER_ENV_VAR))
    except FuselaneConfigError as e:
        bad(e)
    try:
        TelemetryConfig.from_env(env)
    except TelemetryConfigError as e:
        bad(e)
    return errors


def env_errors(config: CanaryConfig) -> list[str]:
    """Each arm's environment, parsed as its engines will parse it at start-up (the plugin's
    `register()`); one line per bad field, a shared `env` value named once."""
    errors = [line for arm in ARMS for line in _arm_env_errors(config, arm)]
    return list(dict.fromkeys(errors))


def outage_errors(config: CanaryConfig) -> list[str]:
    """`rollback.max_outage_s` against the failover timings: after one replica death, the first
    requests sent to custom again go out `cooldown_s` later and may wait up to
    `first_response_timeout_s` for the new replica; an outage limit shorter than that would
    roll back an arm for the restart of one replica."""
    limit, f = config.rollback.max_outage_s, config.failover
    if limit is None or not config.rollback.enabled:
        return []
    floor = f.cooldown_s + f.first_response_timeout_s
    if limit > floor:
        return []
    return [
        f"rollback.max_outage_s: {limit:g} would roll back custom for one replica restart: the "
        f"first retry after a death is sent failover.cooldown_s ({f.cooldown_s:g}) later and "
        f"waits up to failover.first_response_timeout_s ({f.first_response_timeout_s:g}); "
        f"expected above {floor:g}, or null to switch the limit off"
    ]


# ---------------------------------------------------------------------------------------------
# Engine arguments, by vLLM's parser
# ---------------------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def engine_argv(action: argparse.Action, value: Any) -> list[str] | str:
    """The command-line words `vllm serve` takes for one engine argument's YAML value, or why
    there are none. Types stay strict: a flag takes true / false only, and a value takes no
    boolean (`max_num_seqs: true` is not 1)."""
    option = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # a flag: --x / --no-x
        if not isinstance(value, bool):
            return f"expected true or false, got {value!r}"
        if value:
            return [option]
        return [o for o in action.option_strings if o.startswith("--no-")][:1]
    if isinstance(value, bool):
        return f"expected a value for {option}, not a boolean: got {value!r}"
    if isinstance(value, list | tuple) and action.nargs in ("+", "*"):
        return [option, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
    if isinstance(value, dict | list | tuple):
        return [option, json.dumps(value)]
    return [option, str(value)]


def _engine_arg_error(parser: argparse.ArgumentParser, key: str, value: Any) -> str | None:
    from fuselane.plugin.vllm_compat import EngineArgumentError

    options = _options(parser)
    action = options.get(key)
    if action is None:
        close = difflib.get_close_matches(key, options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"not an engine argument of vLLM{hint}"
    if value is None:  # vLLM's default
        return None
    argv = engine_argv(action, value)
    if isinstance(argv, str):
        return argv
    try:
        parser.parse_args(argv)
    except (EngineArgumentError, ValueError, TypeError) as e:
        return f"vLLM's parser refuses {' '.join(argv)!r}: {e}"
    return None


def engine_errors(config: CanaryConfig) -> list[str] | None:
    """Each arm's engine arguments (shared `engine` under the arm's), parsed one by one by vLLM's
    own parser; one line per bad field. None: vLLM's parser is not available here."""
    if not (config.engine or any(config.arm(arm).engine for arm in ARMS)):
        return []
    try:
        from fuselane.plugin import vllm_compat

        parser = vllm_compat.engine_arg_parser()
    except Exception as e:  # noqa: BLE001 - no vLLM here (or it cannot start): say so, go on
        log.warning(
            "canary config: engine arguments not checked: vLLM's parser is not available "
            "here (%s: %s); the replicas will check them when they start",
            type(e).__name__,
            e,
        )
        return None
    errors: list[str] = []
    for arm in ARMS:
        own: Mapping[str, Any] = config.arm(arm).engine
        for key, value in config.arm_engine_kwargs(arm).items():
            problem = _engine_arg_error(parser, key, value)
            if problem is not None:
                field = f"arms.{arm}.engine.{key}" if key in own else f"engine.{key}"
                errors.append(f"{field}: {problem}")
    return list(dict.fromkeys(errors))


# ---------------------------------------------------------------------------------------------
# Warnings
# ---------------------------------------------------------------------------------------------


def config_warnings(config: CanaryConfig) -> list[str]:
    """What the config allows but is likely unintended: one line each."""
    out: list[str] = []
    host = config.http.host
    if not is_loopback(host):
        out.append(
            f"http.host: {host} is not a loopback address: the canary's OpenAI endpoint (no "
            f"authentication) is reachable from other machines; 127.0.0.1 keeps it on this one"
        )
    for arm in ARMS:
        port = TelemetryConfig.from_env(config.arm_env(arm)).port
        if port is not None and not is_loopback(port[0]):
            field = _env_field(config, arm, PORT_ENV)
            out.append(f"{field}: kernel metrics served on {port[0]}, not on a loopback address")
    if config.rollback.min_agreement is not None and config.shadow.fraction == 0:
        out.append(
            "rollback.min_agreement: shadow.fraction is 0, so nothing is mirrored and the "
            "agreement rule judges nothing until a fraction is set (`fuselane canary weight W "
            "--shadow-fraction F`)"
        )
    return list(dict.fromkeys(out))

"""Every private Ray name the canary uses, in one place.

Ray Serve LLM keeps parts the canary builds on under `ray.llm._internal` (the OpenAI ingress'
request models and helpers, the vLLM engine class and the callback base), and Ray Serve has no
public API for a declarative deploy (`serve run CONFIG` calls `ray.serve._private.api`). Finding
and joining the clusters of this machine (`cluster.py`), keeping a demo cluster on 127.0.0.1
(`local_cluster.py`) also need `ray._private` names. They are imported here only, so a Ray
release that moves one fails in one module, and `tests/serving/test_ray_compat.py` checks each
name against the installed Ray.

Importing this module is cheap: the Ray Serve LLM names (`SERVE_LLM_NAMES`) are imported on
first use, because that import takes seconds and logs, and `fuselane canary` finds its cluster
(and says in one line why it cannot) before, and every worker of the demo's cluster runs
`replica_grpc_servers_on_loopback` as it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Resolved by `__getattr__` on first use (`from .ray_compat import VLLMEngine` works as usual).
SERVE_LLM_NAMES = (
    "DEFAULT_ENDPOINTS",
    "DEFAULT_LLM_ROUTER_HTTP_TIMEOUT",
    "NON_STREAMING_RESPONSE_TYPES",
    "CallbackBase",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorResponse",
    "ModelCard",
    "OpenAIHTTPException",
    "RawRequestInfo",
    "VLLMEngine",
    "openai_json_wrapper",
    "router_request_timeout",
    "sanitize_chat_completion_request",
)

__all__ = [
    *SERVE_LLM_NAMES,
    "SINGLE_MACHINE_ENV",
    "enable_token_auth_if_token_available",
    "find_gcs_addresses",
    "latest_ray_start_address",
    "loopback_node",
    "replica_grpc_servers_on_loopback",
    "serve_client",
]

# Ray's switch for single-machine clusters (meant for macOS and Windows): off, a node's address
# is 127.0.0.1 and every server of the node listens there only. Otherwise Ray turns 127.0.0.1
# into the machine's routable address (`services.resolve_ip_for_localhost`), and its servers
# listen on every interface.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _serve_llm_names() -> dict[str, Any]:
    from ray.llm._internal.common.callbacks.base import CallbackBase
    from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
    from ray.llm._internal.serve.core.configs.openai_api_models import (
        ChatCompletionRequest,
        CompletionRequest,
        ErrorResponse,
        ModelCard,
        OpenAIHTTPException,
    )
    from ray.llm._internal.serve.core.ingress.ingress import (
        DEFAULT_ENDPOINTS,
        router_request_timeout,
    )
    from ray.llm._internal.serve.core.ingress.utils import (
        NON_STREAMING_RESPONSE_TYPES,
        _openai_json_wrapper,
        _sanitize_chat_completion_request,
    )
    from ray.llm._internal.serve.core.protocol import RawRequestInfo
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    return {
        "DEFAULT_ENDPOINTS": DEFAULT_ENDPOINTS,
        "DEFAULT_LLM_ROUTER_HTTP_TIMEOUT": DEFAULT_LLM_ROUTER_HTTP_TIMEOUT,
        "NON_STREAMING_RESPONSE_TYPES": NON_STREAMING_RESPONSE_TYPES,
        "CallbackBase": CallbackBase,
        "ChatCompletionRequest": ChatCompletionRequest,
        "CompletionRequest": CompletionRequest,
        "ErrorResponse": ErrorResponse,
        "ModelCard": ModelCard,
        "OpenAIHTTPException": OpenAIHTTPException,
        "RawRequestInfo": RawRequestInfo,
        "VLLMEngine": VLLMEngine,
        "openai_json_wrapper": _openai_json_wrapper,
        "router_request_timeout": router_request_timeout,
        "sanitize_chat_completion_request": _sanitize_chat_completion_request,
    }


def __getattr__(name: str) -> Any:
    if name in SERVE_LLM_NAMES:
        globals().update(_serve_llm_names())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve_client(http: dict[str, Any] | None = None) -> Any:
    """Ray Serve's controller client: the running one, or (with `http`) one started with those
    HTTP options. What `serve run CONFIG` does (ray/serve/scripts.py)."""
    from ray.serve._private import api as serve_api
    from ray.serve.context import _get_global_client

    if http is None:
        return _get_global_client()
    return serve_api.serve_start(http_options=http)


# -- the clusters of this machine ----------------------------------------------------------


def find_gcs_addresses() -> set[str]:
    """The GCS addresses of the Ray clusters with a node on this machine: what
    `ray.init(address="auto")` chooses from (the raylet processes' `--gcs-address`)."""
    from ray._private import services

    services.find_gcs_addresses.cache_clear()  # Ray caches it per process
    return set(services.find_gcs_addresses())


def latest_ray_start_address() -> str | None:
    """The address the last `ray start` on this machine wrote (`/tmp/ray/ray_current_cluster`),
    which `ray.init(address="auto")` prefers when several clusters run; None: no such file."""
    from ray._private import services

    return services.find_bootstrap_address(None)


def enable_token_auth_if_token_available() -> None:
    """What `ray.init(address="auto")` does for a cluster it found on this machine: send the
    token (~/.ray/auth_token, RAY_AUTH_TOKEN) when one exists and RAY_AUTH_MODE is not set."""
    import logging

    from ray._private.authentication import authentication_token_setup as auth

    log = logging.getLogger(auth.__name__)
    saved, log.disabled = log.disabled, True  # Ray warns that it is on: the cluster's setting
    try:
        auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        log.disabled = saved


@contextmanager
def loopback_node() -> Iterator[None]:
    """Within the block, `ray.init` starts or joins a node on 127.0.0.1 as it is: a cluster
    started here listens on 127.0.0.1 only (the processes it starts read the variable), and a
    driver joining one on 127.0.0.1 gets a node address its raylet knows."""
    from ray._private import ray_constants

    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(SINGLE_MACHINE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time; the variable at Ray's import
    os.environ[SINGLE_MACHINE_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(SINGLE_MACHINE_ENV, None)
        else:
            os.environ[SINGLE_MACHINE_ENV] = saved_env


def replica_grpc_servers_on_loopback() -> None:
    """In this process, a Serve replica's gRPC server for the calls of other deployments
    listens on 127.0.0.1, not on every interface: Ray Serve 2.60 binds it to `[::]:0` without an
    option (`ray/serve/_private/replica.py`), and the others reach it at the node's address,
    127.0.0.1 on a loopback node."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0") else address)

    replica.add_port_to_grpc_server = on_loopback

"""Every private Ray name the canary uses, in one place.

Ray Serve LLM keeps parts the canary builds on under `ray.llm._internal` (the OpenAI ingress'
request models and helpers, the vLLM engine class and the callback base), and Ray Serve has no
public API for a declarative deploy (`serve run CONFIG` calls `ray.serve._private.api`). They
are imported here only, so a Ray release that moves one fails in one module, and
`tests/serving/test_ray_compat.py` checks each name against the installed Ray.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, router_request_timeout
from ray.llm._internal.serve.core.ingress.utils import (
    NON_STREAMING_RESPONSE_TYPES,
    _openai_json_wrapper,
    _sanitize_chat_completion_request,
)
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

__all__ = [
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
    "serve_client",
]

openai_json_wrapper = _openai_json_wrapper
sanitize_chat_completion_request = _sanitize_chat_completion_request


def serve_client(http: dict[str, Any] | None = None) -> Any:
    """Ray Serve's controller client: the running one, or (with `http`) one started with those
    HTTP options. What `serve run CONFIG` does (ray/serve/scripts.py)."""
    from ray.serve._private import api as serve_api
    from ray.serve.context import _get_global_client

    if http is None:
        return _get_global_client()
    return serve_api.serve_start(http_options=http)

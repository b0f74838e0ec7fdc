"""The canary ingress: Ray Serve LLM's OpenAI ingress, routing each request to an arm.

`CanaryIngress` is Ray Serve LLM's `OpenAiIngress` (its FastAPI app, request models, error
mapping, `/v1/models`), with the step that picks a model deployment replaced by the canary's:

1. pick the arm (`split.choose_arm`): the pin header, else the sticky key (session header, else
   the OpenAI `user` field), else a coin weighted by the current weight;
2. send the request; for custom, wait for its first response item (the whole answer when not
   streaming) at most `failover.first_response_timeout_s`. If the replica dies, is unreachable,
   times out or answers a server error before that, the request goes to stock instead (no
   byte has reached the client yet, so nothing is lost); a dead or hung replica also diverts
   custom traffic to stock for `failover.cooldown_s`, instead of queueing it for a replica
   that is restarting. A stream cut after its first chunk cannot be retried: it is counted as
   custom's error;
3. mirror a `shadow.fraction` of requests: a greedy copy goes to both arms in the background
   and the answers are compared (`shadow.compare`);
4. report outcomes to the monitor every `REPORT_INTERVAL_S`, and take back the weight in force
   (0 after a rollback).

Responses carry `x-fuselane-arm` (the arm that answered) and, after a failover,
`x-fuselane-failover` (why).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.llm.ingress import OpenAiIngress
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import shadow
from .config import CanaryConfig
from .metrics import IngressMetrics
from .ray_compat import (
    DEFAULT_ENDPOINTS,
    DEFAULT_LLM_ROUTER_HTTP_TIMEOUT,
    NON_STREAMING_RESPONSE_TYPES,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    OpenAIHTTPException,
    RawRequestInfo,
    openai_json_wrapper,
    router_request_timeout,
    sanitize_chat_completion_request,
)
from .split import choose_arm, sticky_key

logger = logging.getLogger("ray.serve")

ARM_HEADER = "x-fuselane-arm"
FAILOVER_HEADER = "x-fuselane-failover"
REPORT_INTERVAL_S = 0.5


class _ArmFailed(Exception):
    """The custom arm failed before its first byte; `reason` is the failover label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class CanaryIngress(OpenAiIngress):
    async def __init__(
        self,
        stock: DeploymentHandle | str,
        custom: DeploymentHandle | str,
        monitor: DeploymentHandle,
        config: dict[str, Any],
    ) -> None:
        """`stock`, `custom`: bound arm deployments (one-app layout) or the names of the apps
        that hold them (multi-app layout: each arm is its own app, redeployed on its own)."""
        self.config = CanaryConfig.model_validate(config)
        model_id = self.config.model.id
        card = ModelCard(
            id=model_id,
            object="model",
            owned_by="fuselane-canary",
            permission=[],
            metadata={
                "model_id": model_id,
                "input_modality": "text",
                "max_request_context_length": self.config.engine.get("max_model_len"),
            },
        )
        # OpenAiIngress's own model-to-handle routing is not used: `_process_llm_request` below
        # replaces it for the two endpoints this ingress mounts.
        super().__init__(llm_deployments={model_id: None}, model_cards={model_id: card})
        self._arm_refs: dict[str, DeploymentHandle | str] = {"stock": stock, "custom": custom}
        self._arms: dict[str, DeploymentHandle] = {}
        self._monitor = monitor
        self._metrics = IngressMetrics()
        self._rng = random.Random()
        # Routing state: the user_config's values, then the monitor's word (rollbacks).
        self._weight = self.config.routing.weight
        self._shadow_fraction = self.config.shadow.fraction
        self._rolled_back = False
        self._epoch = 0  # the operator epoch in force: reports say which epoch they belong to
        self._cooldown_until = 0.0
        self._custom_down = asyncio.Event()
        self._outcomes: list[tuple] = []
        self._comparisons: list[tuple] = []
        self._shadow_tasks: set[asyncio.Task] = set()
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    # -- live configuration ------------------------------------------------------------------

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        weight = float(user_config.get("weight", self.config.routing.weight))
        fraction = float(user_config.get("shadow_fraction", self.config.shadow.fraction))
        epoch = int(user_config.get("epoch", 0))
        if not (0.0 <= weight <= 1.0 and 0.0 <= fraction <= 1.0):
            raise ValueError(f"user_config: weight and shadow_fraction in [0, 1]: {user_config}")
        self._weight, self._shadow_fraction = weight, fraction
        try:
            self._apply(await self._monitor.operator.remote(weight, fraction, epoch))
        except RayError as e:
            logger.warning("fuselane canary: monitor unreachable, weight %s local: %s", weight, e)

    def _apply(self, state: dict[str, Any]) -> None:
        self._weight = state["weight"]
        self._shadow_fraction = state["shadow_fraction"]
        self._rolled_back = state["rolled_back"]
        self._epoch = state["epoch"]

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            outcomes, self._outcomes = self._outcomes, []
            comparisons, self._comparisons = self._comparisons, []
            try:
                self._apply(await self._monitor.report.remote(outcomes, comparisons))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep routing on the last known state
                logger.warning("fuselane canary: report to the monitor failed: %s", e)

    def _record(
        self, arm: str, result: str, latency: float | None, failover: str | None = None
    ) -> None:
        self._outcomes.append((arm, result, latency, failover, self._epoch))
        self._metrics.request(arm, result, latency)
        if failover:
            self._metrics.failover(failover)

    # -- endpoints ---------------------------------------------------------------------------

    async def canary_status(self) -> JSONResponse:
        """`GET /canary/status`: the monitor's view (every ingress replica's traffic)."""
        return JSONResponse(await self._monitor.status.remote())

    async def _process_llm_request(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        call_method: str,
        raw_request: Request | None = None,
    ) -> Response:
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            await self._get_model_id(body.model)  # 404 for a model this app does not serve
            if isinstance(body, ChatCompletionRequest):
                body = sanitize_chat_completion_request(body)
            headers = raw_request.headers if raw_request is not None else {}
            info = RawRequestInfo.from_starlette_request(raw_request) if raw_request else None
            r = self.config.routing
            key = sticky_key(headers, {"user": body.user}, r.session_header, r.use_user_field)
            try:
                decision = choose_arm(
                    self._weight, pin=headers.get(r.pin_header), key=key, rng=self._rng
                )
            except ValueError as e:
                raise OpenAIHTTPException(400, f"{r.pin_header}: {e}", "BadRequestError") from None
            if decision.how != "pinned":
                self._maybe_shadow(body, call_method, info)
            arm, first, gen, t0, failover = await self._start(decision.arm, body, call_method, info)

            first_chunk = first[0] if isinstance(first, list) else first
            out_headers = {ARM_HEADER: arm}
            if failover:
                out_headers[FAILOVER_HEADER] = failover
            if isinstance(first_chunk, ErrorResponse):
                code = int(first_chunk.error.code or 500)
                self._record(arm, "client_error" if code < 500 else "error", None, failover)
                raise OpenAIHTTPException(
                    message=first_chunk.error.message, status_code=code, type=first_chunk.error.type
                )
            if isinstance(first_chunk, NON_STREAMING_RESPONSE_TYPES):
                self._record(arm, "ok", time.perf_counter() - t0, failover)
                return JSONResponse(content=first_chunk.model_dump(), headers=out_headers)
            stream = self._track_stream(arm, first, gen, t0, failover)
            return StreamingResponse(
                openai_json_wrapper(stream), media_type="text/event-stream", headers=out_headers
            )

    # -- routing with failover ---------------------------------------------------------------

    def _handle(self, arm: str) -> DeploymentHandle:
        if arm not in self._arms:
            ref = self._arm_refs[arm]
            if isinstance(ref, str):
                ref = serve.get_deployment_handle(arm, app_name=ref)
            self._arms[arm] = ref.options(stream=True)
        return self._arms[arm]

    def _call(self, arm: str, body: Any, call_method: str, info: RawRequestInfo | None) -> Any:
        return getattr(self._handle(arm), call_method).remote(body, info)

    async def _first_from_custom(
        self, body: Any, call_method: str, info: RawRequestInfo | None
    ) -> tuple[Any, Any]:
        """Custom's first response item, or _ArmFailed. Waits also on the "custom is down"
        event: once one request finds the replica dead or hung, the others queued for it go to
        stock at once instead of each waiting out its timeout."""
        down = self._custom_down
        gen = self._call("custom", body, call_method, info)
        timeout = self.config.failover.first_response_timeout_s
        nxt = asyncio.ensure_future(gen.__anext__())
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({nxt, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not nxt.done():
            nxt.cancel()
            gen.cancel()
            if down.is_set():
                raise _ArmFailed("unavailable", "another request found the custom arm down")
            raise _ArmFailed("timeout", f"no response within {timeout:g}s")
        try:
            first = nxt.result()
        except StopAsyncIteration:
            raise _ArmFailed("error", "empty response") from None
        except (ActorDiedError, ActorUnavailableError, DeploymentUnavailableError) as e:
            raise _ArmFailed("unavailable", f"{type(e).__name__}: {e}") from None
        except RayError as e:
            raise _ArmFailed("error", f"{type(e).__name__}: {e}") from None
        chunk = first[0] if isinstance(first, list) else first
        if isinstance(chunk, ErrorResponse) and int(chunk.error.code or 500) >= 500:
            gen.cancel()
            raise _ArmFailed("error", f"server error {chunk.error.code}: {chunk.error.message}")
        return first, gen

    async def _start(
        self, arm: str, body: Any, call_method: str, info: RawRequestInfo | None
    ) -> tuple[str, Any, Any, float, str | None]:
        failover = None
        now = time.monotonic()
        if arm == "custom" and now < self._cooldown_until:
            arm, failover = "stock", "cooldown"
        elif self._custom_down.is_set() and now >= self._cooldown_until:
            self._custom_down = asyncio.Event()  # cooldown over: try custom again
        if arm == "custom":
            t0 = time.perf_counter()
            try:
                first, gen = await self._first_from_custom(body, call_method, info)
                return "custom", first, gen, t0, None
            except _ArmFailed as e:
                failover = e.reason
                if e.reason in ("timeout", "unavailable"):
                    self._cooldown_until = time.monotonic() + self.config.failover.cooldown_s
                    self._custom_down.set()
                logger.warning(
                    "fuselane canary: custom failed (%s: %s), retrying on stock",
                    e.reason,
                    str(e).splitlines()[0][:200],
                )
                self._record("custom", "error", None)
        t0 = time.perf_counter()
        gen = self._call("stock", body, call_method, info)
        try:
            first = await gen.__anext__()
        except Exception:
            self._record("stock", "error", None, failover)
            raise
        return "stock", first, gen, t0, failover

    async def _track_stream(
        self, arm: str, first: Any, gen: Any, t0: float, failover: str | None
    ) -> AsyncGenerator[Any, None]:
        result = "ok"
        try:
            yield first
            async for item in gen:
                yield item
        except GeneratorExit:
            raise  # the client went away: not the arm's failure
        except Exception:
            result = "error"
            raise
        finally:
            latency = time.perf_counter() - t0 if result == "ok" else None
            self._record(arm, result, latency, failover)

    # -- shadow ------------------------------------------------------------------------------

    def _maybe_shadow(self, body: Any, call_method: str, info: RawRequestInfo | None) -> None:
        if self._shadow_fraction <= 0 or self._rng.random() >= self._shadow_fraction:
            return
        if time.monotonic() < self._cooldown_until:
            return
        if len(self._shadow_tasks) >= self.config.shadow.max_in_flight:
            return  # bounded: mirroring must not pile up behind a slow arm
        task = asyncio.get_running_loop().create_task(self._shadow(body, call_method, info))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(self, body: Any, call_method: str, info: RawRequestInfo | None) -> None:
        chat = call_method == "chat"
        epoch = self._epoch  # a pair started before an operator action is not judged after it
        try:
            data = shadow.shadow_copy(
                body.model_dump(exclude_unset=True), chat, self.config.shadow.max_tokens
            )
            copy = type(body).model_validate(data)
            stock, custom = await asyncio.gather(
                self._answer("stock", copy, call_method, info),
                self._answer("custom", copy, call_method, info),
            )
            ids_s, lp_s = shadow.extract(stock, chat)
            ids_c, lp_c = shadow.extract(custom, chat)
            c = shadow.compare(ids_s, lp_s, ids_c, lp_c)
        except Exception as e:  # noqa: BLE001 - a failed comparison is counted, never raised
            logger.warning("fuselane canary: shadow comparison failed: %s", e)
            self._comparisons.append((None, None, 0.0, epoch))
            self._metrics.compared(None, 0.0, 0.0)
            return
        self._comparisons.append((c.agreement, c.exact, c.max_logprob_diff, epoch))
        self._metrics.compared(c.exact, c.agreement, c.max_logprob_diff)

    async def _answer(
        self, arm: str, body: Any, call_method: str, info: RawRequestInfo | None
    ) -> dict[str, Any]:
        gen = self._call(arm, body, call_method, info)
        timeout = self.config.failover.first_response_timeout_s
        item = await asyncio.wait_for(gen.__anext__(), timeout)
        item = item[0] if isinstance(item, list) else item
        if isinstance(item, ErrorResponse):
            raise RuntimeError(f"{arm}: {item.error.code} {item.error.message}")
        return item.model_dump()


ENDPOINTS = {
    "models": DEFAULT_ENDPOINTS["models"],
    "model_data": DEFAULT_ENDPOINTS["model_data"],
    "completions": DEFAULT_ENDPOINTS["completions"],
    "chat": DEFAULT_ENDPOINTS["chat"],
    "canary_status": lambda app: app.get("/canary/status"),
}


def ingress_deployment(config: CanaryConfig) -> Any:
    """The ingress as a Serve deployment (a fresh FastAPI app each call: no import-time state)."""
    from ray.serve.llm.ingress import make_fastapi_ingress

    cls = make_fastapi_ingress(CanaryIngress, endpoint_map=ENDPOINTS)
    return serve.deployment(
        cls,
        name="CanaryIngress",
        num_replicas=config.ingress.replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        user_config=config.user_config(),
    )

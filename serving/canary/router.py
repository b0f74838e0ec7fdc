"""The canary ingress: Ray Serve LLM's OpenAI ingress, routing each request to an arm.

`CanaryIngress` is Ray Serve LLM's `OpenAiIngress` (its FastAPI app, request models, error
mapping, `/v1/models`), with the step that picks a model deployment replaced by the canary's:

1. read the body: JSON only, as vLLM's server (`Content-Type: application/json`; anything else
   is a 415, a body that is not JSON a 400, both with an OpenAI error object);
2. pick the arm (`split.choose_arm`): the pin header (stock always, custom only where the config
   allows it and never while it is rolled back), else the sticky key (session header, else the
   OpenAI `user` field), else a coin weighted by the current weight;
3. send the request; for custom, wait for its first response item (the whole answer when not
   streaming) at most `failover.first_response_timeout_s`. If the replica dies, is unreachable,
   times out or answers a server error before that, the request goes to stock (no byte has
   reached the client yet); a dead or hung replica also diverts custom traffic to stock for
   `failover.cooldown_s`. That opens an outage, counted once by the rollback rules, which
   lasts until custom answers again (`_custom_failed`). A rollback is
   final: when one fires (or the operator sets weight 0), the requests still waiting on custom
   go to stock at once, and no client request reaches it any more. A stream cut
   after its first chunk ends with an OpenAI error event and no `[DONE]`
   (`fuselane_canary_streams_cut_total`), and counts as the arm's error;
4. mirror a `shadow.fraction` of requests: a greedy copy goes to both arms in the background
   and the answers are compared (`shadow.compare`). Also after a rollback: a copy reaches no
   client, and its comparisons (and the custom replicas' checks) keep showing the operator
   whether custom is still wrong;
5. report outcomes to the monitor every `REPORT_INTERVAL_S`, and take back the weight in force
   (0 after a rollback).

Responses carry `x-fuselane-arm` (the arm that answered) and, after a failover,
`x-fuselane-failover` (why: timeout, unavailable, error, cooldown, rollback, weight_zero).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
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
from .rollback import Outcome
from .split import PinRefused, choose_arm, sticky_key

logger = logging.getLogger("ray.serve")

ARM_HEADER = "x-fuselane-arm"
FAILOVER_HEADER = "x-fuselane-failover"
REPORT_INTERVAL_S = 0.5
JSON_MEDIA_TYPE = "application/json"


class _ArmFailed(Exception):
    """Custom did not answer before its first byte: `reason` is the failover label. Not a
    `failure` of custom's when it was taken away (rollback, weight_zero) while the request
    waited; its answer, if any, is dropped and the request goes to stock."""

    def __init__(self, reason: str, detail: str, failure: bool = True) -> None:
        super().__init__(detail)
        self.reason, self.failure = reason, failure


class _StreamCut(Exception):
    """Ends the SSE stream after its error event, before Ray's wrapper appends `[DONE]`."""


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """An OpenAI error object, as vLLM's server writes it."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _failure_kind(e: BaseException) -> str:
    """The failover label of an exception from an arm's handle."""
    if isinstance(e, ActorDiedError | ActorUnavailableError | DeploymentUnavailableError):
        return "unavailable"
    return "error"


async def read_body(request: Request, model: type[Any]) -> Any:
    """The request's body as `model`, or the 4xx JSONResponse that refuses it. vLLM's server
    refuses a body that is not declared JSON; FastAPI instead hands the raw bytes to the model,
    and Ray's validation handler then fails to serialize them (a 500). Field errors keep Ray's
    400 (RequestValidationError, the same handler as before)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != JSON_MEDIA_TYPE:
        message = (
            f"Unsupported Media Type: the body must be JSON, sent with 'Content-Type: "
            f"{JSON_MEDIA_TYPE}' (got {media or 'no Content-Type'})"
        )
        return JSONResponse(_error_body(415, message, "UnsupportedMediaTypeError"), 415)
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        message = f"the body is not valid JSON ({e}); expected a JSON object ({JSON_MEDIA_TYPE})"
        return JSONResponse(_error_body(400, message, "BadRequestError"), 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False)
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in errors]
        ) from None


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
        self._incident_at: float | None = None  # when custom was last found dead or hung
        self._outage_since: float | None = None  # custom has answered nothing since (monotonic)
        # Set (and replaced) at every change that may take custom away from waiting requests.
        self._changed = asyncio.Event()
        self._outcomes: list[Outcome] = []
        self._comparisons: list[shadow.PairResult] = []
        self._shadow_tasks: set[asyncio.Task] = set()
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    # -- live configuration ------------------------------------------------------------------

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        weight = float(user_config.get("weight", self.config.routing.weight))
        fraction = float(user_config.get("shadow_fraction", self.config.shadow.fraction))
        epoch = int(user_config.get("epoch", 0))
        if not (0.0 <= weight <= 1.0 and 0.0 <= fraction <= 1.0):
            raise ValueError(f"user_config: weight and shadow_fraction in [0, 1]: {user_config}")
        self._set_state(weight, fraction, self._rolled_back, self._epoch)
        try:
            self._apply(await self._monitor.operator.remote(weight, fraction, epoch))
        except RayError as e:
            logger.warning("fuselane canary: monitor unreachable, weight %s local: %s", weight, e)

    def _apply(self, state: dict[str, Any]) -> None:
        self._set_state(
            state["weight"], state["shadow_fraction"], state["rolled_back"], state["epoch"]
        )

    def _set_state(self, weight: float, fraction: float, rolled_back: bool, epoch: int) -> None:
        withdrawn = (rolled_back and not self._rolled_back) or (weight == 0 and self._weight != 0)
        self._weight, self._shadow_fraction = weight, fraction
        self._rolled_back, self._epoch = rolled_back, epoch
        if withdrawn:
            self._notify()

    def _notify(self) -> None:
        """Wake the requests waiting on custom: they look again at whether it is still theirs."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

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
        self,
        arm: str,
        result: str,
        latency: float | None,
        failover: str | None = None,
        judged: bool = True,
        outage_s: float | None = None,
    ) -> None:
        self._outcomes.append(
            Outcome(arm, result, latency, failover, self._epoch, judged, outage_s)
        )
        # A cut stream is a failed request on the dashboards, and counted on its own too.
        self._metrics.request(arm, "error" if result == "stream_cut" else result, latency)
        if result == "stream_cut":
            self._metrics.stream_cut(arm)
        if failover:
            self._metrics.failover(failover)

    # -- endpoints ---------------------------------------------------------------------------

    async def canary_status(self) -> JSONResponse:
        """`GET /canary/status`: the monitor's view (every ingress replica's traffic)."""
        return JSONResponse(await self._monitor.status.remote())

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, CompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._process_llm_request(body, "completions", request)

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._process_llm_request(body, "chat", request)

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
                    self._weight,
                    pin=headers.get(r.pin_header),
                    key=key,
                    rng=self._rng,
                    allow_pin_custom=r.allow_pin_custom,
                    rolled_back=self._rolled_back,
                )
            except PinRefused as e:
                kind = "PermissionDeniedError" if e.status == 403 else "ServiceUnavailableError"
                raise OpenAIHTTPException(e.status, f"{r.pin_header}: {e}", kind) from None
            except ValueError as e:
                raise OpenAIHTTPException(400, f"{r.pin_header}: {e}", "BadRequestError") from None
            if decision.how != "pinned":
                self._maybe_shadow(body, call_method, info)
            att = await self._start(decision.arm, decision.how, body, call_method, info)

            first_chunk = att.first[0] if isinstance(att.first, list) else att.first
            out_headers = {ARM_HEADER: att.arm}
            if att.failover:
                out_headers[FAILOVER_HEADER] = att.failover
            if isinstance(first_chunk, ErrorResponse):
                code = int(first_chunk.error.code or 500)
                self._record(att.arm, "client_error" if code < 500 else "error", None, att.failover)
                raise OpenAIHTTPException(
                    message=first_chunk.error.message, status_code=code, type=first_chunk.error.type
                )
            if isinstance(first_chunk, NON_STREAMING_RESPONSE_TYPES):
                self._record(att.arm, "ok", time.monotonic() - att.started, att.failover)
                return JSONResponse(content=first_chunk.model_dump(), headers=out_headers)
            return StreamingResponse(
                _sse(self._track_stream(att)), media_type="text/event-stream", headers=out_headers
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

    def _check_custom(self, how: str, started: float) -> None:
        """Raise if custom is no longer this request's (started at `started`, monotonic):
        rolled back (any request), weight 0 (unpinned requests), or found down by another
        request since this one was sent."""
        if self._rolled_back:
            raise _ArmFailed("rollback", "the custom arm was rolled back", failure=False)
        if how != "pinned" and self._weight == 0.0:
            raise _ArmFailed("weight_zero", "the custom weight was set to 0", failure=False)
        if self._incident_at is not None and self._incident_at >= started:
            raise _ArmFailed("unavailable", "another request found the custom arm down")

    def _custom_failed(self, reason: str, started: float) -> tuple[bool, float | None]:
        """Note custom's failure of an attempt started at `started`. Returns whether it counts
        in the rollback rules and, for one that does not, how long custom had been out by then
        (None: custom was not out).

        A dead or hung replica (`timeout`, `unavailable`) diverts custom traffic to stock for
        the cooldown and opens an outage, which lasts until custom answers again: the outage
        counts once. The failures of attempts that were in flight when it was found, and of
        those that find custom still dead or hung after the cooldown (Serve queues them while
        it starts another replica), are that outage: a replica's crash is one failure, however
        long its restart takes. A server error answered by a live replica counts every time."""
        now = time.monotonic()
        out_s = None if self._outage_since is None else now - self._outage_since
        if self._incident_at is not None and self._incident_at >= started:
            return False, out_s
        if reason not in ("timeout", "unavailable"):
            return True, None
        self._incident_at = now
        self._cooldown_until = now + self.config.failover.cooldown_s
        self._notify()
        if self._outage_since is not None:
            return False, out_s
        self._outage_since = now
        return True, None

    async def _first_from_custom(
        self, body: Any, call_method: str, info: RawRequestInfo | None, how: str, started: float
    ) -> tuple[Any, Any]:
        """Custom's first response item, or _ArmFailed. Waits also on routing changes: once a
        rollback (or weight 0) takes custom away, or another request finds it dead or hung, the
        requests waiting on it go to stock at once, instead of being answered later by an arm
        that is no longer trusted, or each waiting out its timeout."""
        gen = self._call("custom", body, call_method, info)
        timeout = self.config.failover.first_response_timeout_s
        nxt = asyncio.ensure_future(gen.__anext__())
        try:
            while True:
                # Checked also once the answer is in: nothing of it has reached the client.
                self._check_custom(how, started)
                if nxt.done():
                    break
                remaining = started + timeout - time.monotonic()
                if remaining <= 0:
                    raise _ArmFailed("timeout", f"no response within {timeout:g}s")
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait(
                        {nxt, changed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    changed.cancel()
        except BaseException:
            nxt.cancel()
            gen.cancel()
            raise
        try:
            first = nxt.result()
        except StopAsyncIteration:
            raise _ArmFailed("error", "empty response") from None
        except (RayError, DeploymentUnavailableError) as e:
            raise _ArmFailed(_failure_kind(e), f"{type(e).__name__}: {e}") from None
        chunk = first[0] if isinstance(first, list) else first
        if isinstance(chunk, ErrorResponse) and int(chunk.error.code or 500) >= 500:
            gen.cancel()
            raise _ArmFailed("error", f"server error {chunk.error.code}: {chunk.error.message}")
        return first, gen

    async def _start(
        self, arm: str, how: str, body: Any, call_method: str, info: RawRequestInfo | None
    ) -> _Attempt:
        failover = None
        if arm == "custom" and time.monotonic() < self._cooldown_until:
            arm, failover = "stock", "cooldown"
        if arm == "custom":
            started = time.monotonic()
            try:
                first, gen = await self._first_from_custom(body, call_method, info, how, started)
                self._outage_since = None  # custom answers again: an outage ends here
                return _Attempt("custom", first, gen, started, None)
            except _ArmFailed as e:
                failover = e.reason
                if e.failure:
                    logger.warning(
                        "fuselane canary: custom failed (%s: %s), retrying on stock",
                        e.reason,
                        str(e).splitlines()[0][:200],
                    )
                    judged, out_s = self._custom_failed(e.reason, started)
                    self._record("custom", "error", None, judged=judged, outage_s=out_s)
        started = time.monotonic()
        gen = self._call("stock", body, call_method, info)
        try:
            first = await gen.__anext__()
        except Exception:
            self._record("stock", "error", None, failover)
            raise
        return _Attempt("stock", first, gen, started, failover)

    async def _track_stream(self, att: _Attempt) -> AsyncGenerator[Any, None]:
        """The stream after its first item. A failure now cannot be retried (bytes have reached
        the client): the stream ends with an error event and without `[DONE]`, so that no
        client takes the partial answer for a complete one."""
        result, judged, out_s = "ok", True, None
        try:
            yield att.first
            async for item in att.gen:
                yield item
        except GeneratorExit:
            raise  # the client went away: not the arm's failure
        except Exception as e:
            result, kind = "stream_cut", _failure_kind(e)
            if att.arm == "custom":
                judged, out_s = self._custom_failed(kind, att.started)
            reason = shadow.failure_reason(e)
            logger.warning("fuselane canary: %s stream cut: %s", att.arm, reason.splitlines()[0])
            message = f"the {att.arm} arm failed during the stream ({kind}); the answer is cut"
            yield f"data: {json.dumps(_error_body(500, message, 'InternalServerError'))}\n\n"
            raise _StreamCut() from e
        finally:
            latency = time.monotonic() - att.started if result == "ok" else None
            self._record(att.arm, result, latency, att.failover, judged, out_s)

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
        model = type(body)

        async def answer(arm: str, data: dict[str, Any]) -> dict[str, Any]:
            return await self._answer(arm, model.model_validate(data), call_method, info)

        # The epoch now: a pair started before an operator action is not judged after it.
        pair = await shadow.run_pair(
            answer,
            body.model_dump(exclude_unset=True),
            call_method == "chat",
            self.config.shadow.max_tokens,
            self._epoch,
        )
        if pair.error is not None:
            logger.warning("fuselane canary: shadow comparison failed: %s", pair.error)
        self._comparisons.append(pair)
        self._metrics.compared(pair.exact, pair.agreement or 0.0, pair.max_logprob_diff)

    async def _answer(
        self, arm: str, body: Any, call_method: str, info: RawRequestInfo | None
    ) -> dict[str, Any]:
        gen = self._call(arm, body, call_method, info)
        timeout = self.config.failover.first_response_timeout_s
        try:
            item = await asyncio.wait_for(gen.__anext__(), timeout)
        except TimeoutError:
            gen.cancel()
            raise TimeoutError(f"{arm}: no answer within {timeout:g}s") from None
        except BaseException:
            gen.cancel()  # cancelled (a rollback) or failed: release the arm's request
            raise
        item = item[0] if isinstance(item, list) else item
        if isinstance(item, ErrorResponse):
            raise RuntimeError(f"{arm}: {item.error.code} {item.error.message}")
        return item.model_dump()


@dataclass
class _Attempt:
    """The arm that answers a request, its first item and the rest of its answer."""

    arm: str
    first: Any
    gen: Any
    started: float  # time.monotonic() when the attempt was sent
    failover: str | None


async def _sse(items: AsyncGenerator[Any, None]) -> AsyncGenerator[str, None]:
    """Ray's SSE wrapper, except that a cut stream ends with its error event: no `[DONE]`."""
    try:
        async for packet in openai_json_wrapper(items):
            yield packet
    except _StreamCut:
        return

"""The OpenAI-compatible gateway: production traffic served by the rollout fleet's engine, recorded for RL.

Routes (JSON; every route but ``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <tenant token>``,
`rlbus.serve.auth`; ``/metrics`` and the details of ``/healthz`` are the operator's, see Access below):

=================================  =====================================================================
``POST /v1/chat/completions``      OpenAI chat completions: messages, tools / tool_choice, n, temperature,
                                   top_p, max_tokens, stop, seed, logprobs / top_logprobs, stream (SSE,
                                   ending ``data: [DONE]``), user, metadata, response_format (the field
                                   policy: `rlbus.serve.api`)
``POST /v1/responses``             OpenAI's Responses API, played as the chat request its items map to
                                   (`rlbus.serve.openai_responses`), streamed as its events
``GET|DELETE /v1/responses/{id}``  a stored response (``store``, this gateway's memory)
``GET /v1/models``                 the one model this gateway serves
``POST /rl/sessions/{id}/reward``  close an agent session with a reward (below) → 202 with where the
                                   rollout and the reward landed
``GET /rl/sessions/{id}``          an open session's turns, tokens, edits, oldest version
``GET /healthz``                   ``{"ok": true}``; for the operator also the version served, recorder
                                   and session counters
``GET /metrics``                   the process's Prometheus metrics (as vLLM serves them on its port), for
                                   the operator only
=================================  =====================================================================

Access (`rlbus.exposure`). A gateway never starts without tenant tokens (`rlbus.serve.auth.load_tenants`
refuses), and `Gateway.run` checks the bind address before listening. A tenant sees only its own sessions:
another tenant's session id is a 404 (``session_not_found``) on every session route and when a chat
completion names it in ``X-RL-Session``, exactly as an unknown id. The operator is whoever holds the metrics
token (``$RLBUS_METRICS_TOKEN`` / ``$RLBUS_METRICS_TOKEN_FILE``, as for `rlbus.metrics.serve_metrics`);
without one configured, operator routes are open on a loopback bind and closed (401) on any other. Tenant
tokens never open them. Every 401 is logged at WARNING with path and peer, never the token.

The engine is the one a rollout worker uses (`rlbus.wiring.rollout.rollout_stack`: the torch engine behind
the batching engine, weights following the trainer through `rlbus.weights.sync.WeightSync`), so served
requests join the rollouts' continuous batch and are sampled by the very version the fleet holds. Every
response says which: ``system_fingerprint`` is ``rlbus:<model_id>:v<lo>[-v<hi>]`` over its tokens' versions
and the ``X-RL-Policy-Version`` header the same ``<lo>[-<hi>]``; the body's extra ``rl`` object lists
them per choice. Generation runs on a thread pool, never on the event loop.

Recording: every choice of every completion becomes one `rlbus.schemas.Served` on ``rl.served.v1``
(`rlbus.serve.recorder`: buffered, never delaying or failing a response). The response ``id`` is the
handle user feedback names.

Contract with the trainer side (online learning: the trainer worker's online lane,
`rlbus.training.online_lane`, relies on it; change both together):

* **A closed agent session becomes ONE `Rollout`** on ``rl.rollouts.v1`` with ``group_size=1``,
  ``group_index=0``, ``prompt_id`` = the session's task key (the client's ``metadata.task``, else the
  session id), ``rollout_id`` = the session id, ``token_ids`` / ``loss_mask`` / ``logprobs`` /
  ``token_versions`` laid out as the agent loop lays them out (loss mask 1 exactly on sampled ids; every
  turn the session sampled, a turn the client dropped or edited as a context segment of its own, marked
  by ``turns[].segment``: `rlbus.serve.sessions`), ``allowed`` (the masks of constrained tokens), its
  sampling info, and ``metadata`` {``origin: "served"``, ``tenant``, ``session_id``, ``request_ids``
  (comma-joined), ``history_edits``, ``turns``, ``segments``}.
* **A single completion recorded as a rollout** (header ``X-RL-Record-Rollout: 1`` or
  ``metadata.rl_record_rollout = "1"``) becomes such a Rollout too, ``rollout_id`` = the completion
  ``id``, ``prompt_id`` = ``metadata.task`` or the id — so feedback on the response id
  (`rlbus.producers.feedback`, source ``"user"``; give ``prompt_id`` = the ``X-RL-Prompt-Id`` header,
  since the id has no ``/<index>``) joins with it. With ``n`` > 1 the choices form one group:
  ``rollout_id`` ``<id>/<i>``, ``group_size`` n, ``prompt_id`` the id (a GRPO group; feedback then
  needs no prompt_id).
* **The reward of a session** (``POST /rl/sessions/{id}/reward``, body ``{"reward": number in [0, 1],
  "source"?: str, "components"?: {str: number}, "reason"?: str}``) is one `Reward` on ``rl.rewards.v1``,
  key ``rollout_id`` = the session id, ``source`` ``"user"`` unless the body says otherwise, ``reward_id``
  ``<session>:<source>:session``, published after the rollout. A reward outside [0, 1] (NaN, ±inf
  included), an unknown field or a body that is not a JSON object is a 400 and the session stays open; an
  unknown, expired, already closed or other tenant's session is a 404, a session without a sampled turn a
  409. A bus that fails answers 503 with Retry-After and keeps the session open, so the client can retry.

Sessions are marked by ``X-RL-Session: <id>`` (or the ``user`` field, with ``user_sessions`` on). Admission
control (`rlbus.serve.admission`) may answer them 429 with ``Retry-After``; requests that are neither a
session nor recorded as a rollout are never refused for staleness.

This module holds the routes and plays a request (`rlbus.serve.call.Call`); answers are shaped in
`rlbus.serve.responses`, streamed in `rlbus.serve.streaming`, and recorded through `rlbus.serve.records`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from rlbus.bus.base import Bus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.engines.base import Engine, GenerationRequest, GenerationResult
from rlbus.engines.constraints import Constraint, Grammars
from rlbus.envs.chat import ChatFormat
from rlbus.errors import ApiError, BusError
from rlbus.exposure import BearerAuth, check_bind, is_loopback, load_token
from rlbus.metrics import (
    CONTENT_TYPE as METRICS_CONTENT_TYPE,
)
from rlbus.metrics import (
    SERVE_HISTORY_EDITS,
    SERVE_LATENCY_SECONDS,
    SERVE_REQUESTS,
    SERVE_TOKENS,
    exposition,
)
from rlbus.observe.stats import percentile
from rlbus.serve import api, openai_responses, responses
from rlbus.serve.admission import Admission
from rlbus.serve.auth import Tenants
from rlbus.serve.call import RECORD_HEADER, SESSION_HEADER, Call
from rlbus.serve.openai_responses import ResponseStore
from rlbus.serve.prompt import render
from rlbus.serve.recorder import ServedRecorder
from rlbus.serve.records import completion_rollout, sampled_turn, sampling, served_record
from rlbus.serve.responses import error_response, json_response
from rlbus.serve.sessions import Sessions, session_reward
from rlbus.serve.streaming import Sink, stream_completion, stream_text

log = logging.getLogger("rlbus.serve.gateway")

MAX_BODY_BYTES = 1024 * 1024
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def cluster_topic(bus: Bus, name: str) -> str:
    """The name a topic has on the cluster: ``name`` under every namespace ``bus`` wraps it in (a receipt
    names where the record really is)."""
    while True:
        if isinstance(bus, NamespacedBus):
            name = bus.outer(name)
        inner = getattr(bus, "inner", None)
        if not isinstance(inner, Bus):
            return name
        bus = inner


class Gateway:
    def __init__(
        self,
        *,
        engine: Engine,
        chat: ChatFormat,
        tenants: Tenants,
        model_name: str,
        max_context: int,
        recorder: ServedRecorder | None = None,
        rollouts: ServedRecorder | None = None,
        bus: Bus | None = None,
        admission: Admission | None = None,
        sessions: Sessions | None = None,
        model_id: str = "policy",
        worker_id: str = "gateway",
        region: str = "",
        default_max_tokens: int = 256,
        max_n: int = api.MAX_N,
        max_body_bytes: int = MAX_BODY_BYTES,
        user_sessions: bool = False,
        threads: int = 64,
        publish_timeout_s: float = 10.0,
        connect: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
        metrics_token: str | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``recorder`` writes ``rl.served.v1``, ``rollouts`` the rollouts of completions recorded as rollouts
        (both buffered), ``bus`` takes session rollouts and rewards (acknowledged before the 202). Without a
        ``bus`` sessions cannot be closed; without a recorder nothing is recorded. ``connect`` starts a bus
        that was not started (it may be down), before a session is published. ``metrics_token`` (else the
        configured metrics token, read by `run`) opens the operator routes (module docstring, Access).
        ``grammars``: the engine's constrained decoding (`rlbus.engines.constraints`); None refuses requests
        that need it (``tool_choice`` required or named, ``response_format`` json)."""
        self.engine = engine
        self.chat = chat
        self.tenants = tenants
        self.model_name = model_name
        self.model_id = model_id
        self.max_context = max_context
        self.recorder = recorder
        self.rollouts = rollouts
        self._bus = bus
        self.admission = admission
        self.sessions = sessions or Sessions()
        self.worker_id = worker_id
        self.region = region
        self.default_max_tokens = default_max_tokens
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.user_sessions = user_sessions
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._publish_timeout_s = publish_timeout_s
        self._connect = connect
        self._clock = clock
        self.served = 0
        self.history_edits = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._latencies: deque[float] = deque(maxlen=1000)
        #: Seconds each recent non-streamed completion spent in the gateway itself (its whole handling
        #: minus the engine call): the gateway's own cost, free of the engine's load.
        self.own_seconds: deque[float] = deque(maxlen=1000)
        self.address: tuple[str, int] | None = None
        self.listening = asyncio.Event()
        self.metrics_token = metrics_token
        self.grammars = grammars
        self.responses_store = ResponseStore()
        self._operator_auth: BearerAuth | None = None
        self._operator_open = False  # set by run: no metrics token and a loopback bind

    def stats(self) -> dict[str, Any]:
        """What the gateway's heartbeat carries (the dashboard's serving card): traffic over the latest
        1,000 completions' latencies, tokens, recording, admission refusals, sessions."""
        latencies = list(self._latencies)
        recorder = self.recorder.stats() if self.recorder is not None else {}
        return {
            "version": self.engine.policy_version, "processed": self.served, "served": self.served,
            "latency_p50_ms": round(percentile(latencies, 50) * 1000, 1) if latencies else None,
            "latency_p99_ms": round(percentile(latencies, 99) * 1000, 1) if latencies else None,
            "own_p50_ms": round(percentile(list(self.own_seconds), 50) * 1000, 2) if self.own_seconds else None,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "recorded": recorder.get("recorded"), "buffered": recorder.get("buffered"),
            "dropped": recorder.get("dropped"), "down": recorder.get("down"),
            "rejected": sum(self.admission.refused.values()) if self.admission is not None else 0,
            "sessions_open": len(self.sessions), "history_edits": self.history_edits,
        }

    # -- app -------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.max_body_bytes)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{response_id}", self._stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self._stored_response)
        app.router.add_post("/rl/sessions/{session_id}/reward", self._session_reward)
        app.router.add_get("/rl/sessions/{session_id}", self._session_info)
        app.on_cleanup.append(self._shutdown_executor)
        return app

    async def run(self, stop: asyncio.Event, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until ``stop``; the recorders' drain tasks run alongside in one task group. A bind address
        other than loopback without tenant tokens, or a bad metrics token, is a ConfigError before anything
        listens."""
        check_bind(host, service="serve", auth_configured=bool(self.tenants.names))
        token = self.metrics_token or load_token("metrics")
        self._operator_auth = BearerAuth("metrics", token) if token is not None else None
        self._operator_open = token is None and is_loopback(host)
        if token is None and not self._operator_open:
            log.warning("the gateway's /metrics and /healthz details are closed on %s: set RLBUS_METRICS_TOKEN "
                        "(or RLBUS_METRICS_TOKEN_FILE) to scrape them", host)
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            async with asyncio.TaskGroup() as tasks:
                for recorder in (self.recorder, self.rollouts):
                    if recorder is not None:
                        tasks.create_task(recorder.run(stop))
                await web.TCPSite(runner, host, port).start()
                self.address = (host, int(runner.addresses[0][1]))
                self.listening.set()
                log.info("OpenAI-compatible gateway on http://%s:%d serving %s", *self.address, self.model_name)
                await stop.wait()
        finally:
            await runner.cleanup()

    async def _shutdown_executor(self, app: web.Application) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="serve")
        return self._executor

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        try:
            response = await handler(request)
        except ApiError as exc:
            if exc.status == 401:  # the reason, the path and the peer; never the token
                log.warning("serve: refused %s %r from %s: %s", request.method, request.path,
                            request.remote or "unknown peer", exc.message)
            response = error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            response = error_response(ApiError(413, f"request body exceeds {self.max_body_bytes} bytes",
                                                code="request_too_large"))
        except web.HTTPNotFound:
            response = error_response(ApiError(404, f"no route {request.method} {request.path}",
                                                code="unknown_url"))
        except web.HTTPMethodNotAllowed:
            response = error_response(ApiError(405, f"{request.method} is not allowed on {request.path}",
                                                code="method_not_allowed"))
        except Exception as exc:  # never a bare traceback to a client; logged with the request
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                                code="internal_error"))
        SERVE_REQUESTS.labels(route, str(response.status)).inc()
        return response

    def _operator_refusal(self, request: web.Request) -> str | None:
        """None when ``request`` may see the operator routes (module docstring, Access), else why not."""
        if self._operator_auth is not None:
            if self._operator_auth.accepts(request):
                return None
            return "missing or wrong metrics token: send 'Authorization: Bearer <RLBUS_METRICS_TOKEN>'"
        if self._operator_open:
            return None
        return ("this gateway's metrics are served off-host only with a metrics token: set RLBUS_METRICS_TOKEN "
                "(or RLBUS_METRICS_TOKEN_FILE) where it runs")

    # -- routes ------------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self._operator_refusal(request) is not None:
            return json_response(200, {"ok": True})  # a liveness probe learns nothing more
        return json_response(200, {
            "ok": True, "model": self.model_name, "version": self.engine.policy_version, "served": self.served,
            "sessions_open": len(self.sessions), "history_edits": self.history_edits,
            "recorder": None if self.recorder is None else self.recorder.stats(),
            "admission_refused": {} if self.admission is None else dict(self.admission.refused),
        })

    async def _metrics(self, request: web.Request) -> web.Response:
        refusal = self._operator_refusal(request)
        if refusal is not None:
            raise ApiError(401, refusal, code="invalid_api_key")
        return web.Response(body=exposition(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        self.tenants.tenant_of(request.headers.get("Authorization"))
        return json_response(200, {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlbus"}]})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise ApiError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        body = await request.read()
        call = self._prepare(api.parse_request(body, max_n=self.max_n), request, tenant, started)
        if call.request.stream:
            return await self._stream(request, call)
        engine_started = time.perf_counter()
        results = await self._generate(call.engine_requests)
        engine_s = time.perf_counter() - engine_started
        body_out = self._finish(call, results)
        response = json_response(200, body_out, headers=responses.headers(call, results, self.engine.policy_version))
        self.own_seconds.append(time.perf_counter() - started - engine_s)
        return response

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: played as the chat request it maps to (`rlbus.serve.openai_responses`)."""
        started = time.perf_counter()
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise ApiError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        req = openai_responses.parse(await request.read())
        store = self.responses_store
        history = store.previous(req.previous_response_id, tenant) if req.previous_response_id else []
        chat_req = openai_responses.to_chat(req, history, lambda item_id: store.item(item_id, tenant))
        call = self._prepare(chat_req, request, tenant, started, id_prefix="resp")
        created = self._clock()
        if req.stream:
            return await self._stream_response(request, call, req, created)
        results = await self._generate(call.engine_requests)
        body = openai_responses.response_body(req, self._finish(call, results), response_id=call.served_id,
                                              created=created)
        self._keep(req, call, body)
        return json_response(200, body, headers=responses.headers(call, results, self.engine.policy_version))

    async def _stream_response(self, http: web.Request, call: Call, req: openai_responses.ResponsesRequest,
                               created: float) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            **responses.headers(call, None, self.engine.policy_version)})
        await response.prepare(http)
        sink = Sink(response)
        events = openai_responses.EventStream(
            openai_responses.response_body(req, None, response_id=call.served_id, created=created))
        for event in events.start():
            await sink.send(event)

        async def text(i: int, piece: str) -> None:
            for event in events.delta(piece):
                await sink.send(event)

        try:
            results, _ = await stream_text(call, self.chat, self._generate, text)
        except Exception as exc:  # headers are out: the failure becomes the stream's last event
            await sink.fail(call, exc, events.error)
            return response
        body = openai_responses.response_body(req, self._finish(call, results), response_id=call.served_id,
                                              created=created)
        self._keep(req, call, body)
        for event in events.finish(body):
            await sink.send(event)
        await sink.close()
        return response

    def _keep(self, req: openai_responses.ResponsesRequest, call: Call, body: dict[str, Any]) -> None:
        if req.store is not False:
            self.responses_store.put(call.tenant, body, openai_responses.conversation(call.request, body["output"]))

    async def _stored_response(self, request: web.Request) -> web.Response:
        """``GET`` a stored response, or ``DELETE`` it (a 404 when it is not stored for this tenant)."""
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        response_id = request.match_info["response_id"]
        stored = self.responses_store.get(response_id, tenant)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
        if request.method == "DELETE":
            self.responses_store.delete(response_id, tenant)
            return json_response(200, {"id": response_id, "object": "response.deleted", "deleted": True})
        return json_response(200, stored.body)

    async def _session_info(self, request: web.Request) -> web.Response:
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        session = self.sessions.owned(request.match_info["session_id"], tenant)
        parts = session.segments()
        return json_response(200, {
            "session_id": session.session_id, "task": session.task, "turns": len(session.sampled),
            "segments": len(parts), "tokens": sum(len(p.ids) for p in parts),
            "sampled_tokens": sum(sum(p.mask) for p in parts),
            "history_edits": session.edits, "oldest_version": session.oldest_version,
            "request_ids": session.request_ids,
        })

    async def _session_reward(self, request: web.Request) -> web.Response:
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        session = self.sessions.owned(request.match_info["session_id"], tenant)
        if session.closing:
            raise ApiError(409, f"session {session.session_id!r} is being closed by another request",
                           param="session_id", code="session_closing")
        try:
            body = json.loads(await request.read() or b"{}")
        except (ValueError, RecursionError) as exc:  # bad JSON, bytes that are not UTF-8, nesting too deep
            raise api.bad(f"the body is not valid JSON: {exc}"[:300], code="invalid_json") from None
        if not isinstance(body, dict):
            raise api.bad("the body must be a JSON object with 'reward'")
        now = self._clock()
        reward = session_reward(session, body, now=now)
        rollout = session.rollout(model_id=self.model_id, worker_id=self.worker_id, region=self.region, now=now)
        if self._bus is None:
            raise ApiError(503, "this gateway has no bus to publish sessions on", type="server_error",
                           code="no_bus", retry_after_s=30)
        session.closing = True
        try:
            async with asyncio.timeout(self._publish_timeout_s):
                if self._connect is not None:
                    await self._connect()
                at_rollout = await self._bus.send(ROLLOUTS, rollout)
                at_reward = await self._bus.send(REWARDS, reward)
        except (BusError, TimeoutError) as exc:
            session.closing = False
            log.warning("session %s not closed: %s", session.session_id, exc or type(exc).__name__)
            raise ApiError(503, f"bus unavailable: {exc or 'no acknowledgement in time'}", type="server_error",
                           code="bus_unavailable", retry_after_s=5) from None
        self.sessions.close(session.session_id)
        rollout_topic = cluster_topic(self._bus, at_rollout.topic)
        reward_topic = cluster_topic(self._bus, at_reward.topic)
        sampled = int(rollout.loss_mask.to_numpy().sum())
        log.info("session %s closed: rollout at %s[%d]@%d (%d tokens, %d sampled, %d turns in %d segments), "
                 "reward %.3f (%s)", session.session_id, rollout_topic, at_rollout.partition, at_rollout.offset,
                 rollout.token_ids.numel, sampled, len(session.sampled), len(session.segments()), reward.value,
                 reward.source, extra={"rollout_id": rollout.rollout_id, "topic": rollout_topic,
                                       "partition": at_rollout.partition, "offset": at_rollout.offset})
        return json_response(202, {
            "rollout_id": rollout.rollout_id, "prompt_id": rollout.prompt_id,
            "tokens": rollout.token_ids.numel, "sampled_tokens": sampled,
            "turns": int(rollout.metadata["turns"]), "segments": int(rollout.metadata["segments"]),
            "rollout": {"topic": rollout_topic, "partition": at_rollout.partition, "offset": at_rollout.offset},
            "reward": {"reward_id": reward.reward_id, "value": reward.value, "source": reward.source,
                       "topic": reward_topic, "partition": at_reward.partition, "offset": at_reward.offset},
        })

    # -- a completion ------------------------------------------------------------------------------------

    def _prepare(self, req: api.ChatRequest, http: web.Request, tenant: str, started: float,
                 id_prefix: str = "") -> Call:
        if req.model not in (self.model_name, self.model_id):
            raise ApiError(404, f"the model {req.model!r} does not exist; this gateway serves {self.model_name!r}",
                           param="model", code="model_not_found")
        served_id = api.new_id(id_prefix, "_") if id_prefix else api.new_id()
        request_id = http.headers.get("X-Request-Id", served_id)[:128]
        metadata = req.metadata or {}
        session_id = http.headers.get(SESSION_HEADER) or (req.user if self.user_sessions else None)
        record_rollout = (http.headers.get(RECORD_HEADER, "").lower() in ("1", "true", "yes")
                          or metadata.get("rl_record_rollout") in ("1", "true"))
        if session_id is not None and not _SESSION_ID.match(session_id):
            raise api.bad("a session id is 1-128 of [A-Za-z0-9_.:-]", SESSION_HEADER)
        if session_id is not None and req.n != 1:
            raise api.bad("an RL session samples one choice per turn: n must be 1", "n")
        session = self.sessions.get(session_id) if session_id else None
        if session is not None and session.tenant != tenant:
            raise ApiError(404, f"no session {session_id!r}", param=SESSION_HEADER, code="session_not_found")
        if (session_id or record_rollout) and self.admission is not None:
            self.admission.check(served_version=self.engine.policy_version,
                                 oldest=None if session is None else session.oldest_version,
                                 opening=session_id is not None and session is None, open_sessions=len(self.sessions))
        tools = api.tool_schemas(req)
        messages = api.internal_messages(req)
        try:  # a new session maps nothing yet: its assistant messages are reported as edits
            context = render(self.chat, messages, tools=tools,
                             recorded=None if session_id is None else {} if session is None else session.turns)
        except ValueError as exc:
            raise api.bad(f"this model's chat format cannot take tools: {exc}", "tools", "unsupported_value") from None
        context.add(self.chat.model_header)
        room = self.max_context - len(context.ids)
        asked = req.max_completion_tokens or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise api.bad(f"the prompt is {len(context.ids)} tokens and max_tokens {asked or 1}; this model's "
                          f"context is {self.max_context}", "messages", "context_length_exceeded")
        max_tokens = min(asked or self.default_max_tokens, room)
        constraint = self._constraint(req)
        first_call_only = api.ends_at_first_call(req)
        stops = (*api.stops_of(req), *([api.CALL_END] if first_call_only else []))
        engine_requests = [
            GenerationRequest(
                prompt_ids=tuple(context.ids), max_new_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=stops,
                stop_token_ids=self.chat.stop_ids, seed=None if req.seed is None else req.seed + i,
                request_id=f"{served_id}/{i}", top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                constraint=constraint,
            )
            for i in range(req.n)
        ]
        if session_id is not None and session is None:  # opened only once nothing can refuse the request
            session = self.sessions.open(session_id, tenant=tenant, task=metadata.get("task"))
        if context.edits and session is not None:
            session.edits += 1
            self.history_edits += 1
            SERVE_HISTORY_EDITS.inc()
            log.info("session %s: history edited (%s)", session.session_id, "; ".join(context.edits))
        return Call(served_id=served_id, request_id=request_id, tenant=tenant, request=req, context=context,
                    engine_requests=engine_requests, tools=tools is not None, session=session,
                    record_rollout=record_rollout, edits=context.edits, started=started, position=len(messages),
                    first_call_only=first_call_only)

    def _constraint(self, req: api.ChatRequest) -> Constraint | None:
        """The grammar the request asks for (`rlbus.serve.api.constraint_of`), checked against this engine."""
        constraint = api.constraint_of(req)
        if constraint is None:
            return None
        param = "response_format" if req.response_format is not None and req.response_format.type != "text" and (
            req.tool_choice in (None, "auto", "none")) else "tool_choice"
        if self.grammars is None:
            raise api.bad(f"{param}: this engine does not do constrained decoding", param, "unsupported_value")
        try:
            self.grammars.check(constraint)
        except ValueError as exc:
            raise api.bad(f"{param}: the schema does not compile: {exc}"[:500], param) from None
        return constraint

    async def _generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), self.engine.generate, list(requests))

    def _finish(self, call: Call, results: list[GenerationResult]) -> dict[str, Any]:
        """The response body; records every choice, updates the session, publishes recorded rollouts."""
        choices = []
        for i, result in enumerate(results):
            choice, content, calls = responses.choice(call, i, result, self.chat)
            choices.append(choice)
            self._record(call, i, result, choice["finish_reason"])
            if i == 0 and call.session is not None:
                self._add_to_session(call, result, content, calls, choice["finish_reason"])
        if call.record_rollout:
            self._publish_rollouts(call, results, [c["finish_reason"] for c in choices])
        completion = sum(len(r.token_ids) for r in results)
        prompt = len(call.context.ids)
        SERVE_TOKENS.labels("prompt").inc(prompt)
        SERVE_TOKENS.labels("completion").inc(completion)
        latency = time.perf_counter() - call.started
        SERVE_LATENCY_SECONDS.observe(latency)
        self._latencies.append(latency)
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.served += 1
        return {
            "id": call.served_id, "object": "chat.completion", "created": int(self._clock()),
            "model": call.request.model, "system_fingerprint": responses.fingerprint(self.model_id, results),
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "rl": responses.rl_info(call, results),
        }

    def _record(self, call: Call, i: int, result: GenerationResult, finish: str) -> None:
        if self.recorder is None:
            return
        self.recorder.record(served_record(call, i, result, finish, model_id=self.model_id, worker_id=self.worker_id,
                                           region=self.region, clock=self._clock))

    def _add_to_session(self, call: Call, result: GenerationResult, content: str | None, calls: list[Any],
                        finish: str) -> None:
        assert call.session is not None
        turn = sampled_turn(result, content, calls, finish, position=call.position)
        call.session.add_turn(call.context, turn, header_len=len(self.chat.model_header),
                              closing=list(self.chat.turn_closing(result.token_ids)), sampling=sampling(result),
                              request_id=call.served_id, now=self._clock())

    def _publish_rollouts(self, call: Call, results: list[GenerationResult], finishes: list[str]) -> None:
        if self.rollouts is None:
            return
        for i, result in enumerate(results):
            self.rollouts.record(completion_rollout(
                call, i, result, finishes[i], group_size=len(results), chat=self.chat, model_id=self.model_id,
                worker_id=self.worker_id, region=self.region, clock=self._clock))

    # -- streaming ---------------------------------------------------------------------------------------

    async def _stream(self, http: web.Request, call: Call) -> web.StreamResponse:
        return await stream_completion(http, call, engine=self.engine, chat=self.chat, model_id=self.model_id,
                                       generate=self._generate, finish=self._finish, clock=self._clock)

"""The OpenAI-compatible gateway: production traffic served by the rollout fleet's engine, recorded for RL.

Routes (JSON; every route but ``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <tenant token>``,
`rlbus.serve.auth`):

=================================  =====================================================================
``POST /v1/chat/completions``      OpenAI chat completions: messages, tools / tool_choice, n, temperature,
                                   top_p, max_tokens, stop, seed, logprobs / top_logprobs, stream (SSE,
                                   ending ``data: [DONE]``), user, metadata (`rlbus.serve.api`)
``GET /v1/models``                 the one model this gateway serves
``POST /rl/sessions/{id}/reward``  close an agent session with a reward (below) → 202 with where the
                                   rollout and the reward landed
``GET /rl/sessions/{id}``          an open session's turns, tokens, edits, oldest version
``GET /healthz``                   version served, recorder and session counters
``GET /metrics``                   the process's Prometheus metrics (as vLLM serves them on its port)
=================================  =====================================================================

The engine is the one a rollout worker uses (`rlbus.wiring.rollout.rollout_stack`: the torch engine behind
the batching engine, weights following the trainer through `rlbus.weights.sync.WeightSync`), so served
requests join the rollouts' continuous batch and are sampled by the very version the fleet holds. Every
response says which: ``system_fingerprint`` is ``rlbus:<model_id>:v<lo>[-v<hi>]`` over its tokens' versions
and the ``X-RL-Policy-Version`` header the same ``<lo>[-<hi>]``; the body's extra ``rl`` object lists
them per choice. Generation runs on a thread pool, never on the event loop.

Recording: every choice of every completion becomes one `rlbus.schemas.Served` on ``rl.served.v1``
(`rlbus.serve.recorder`: buffered, never delaying or failing a response). The response ``id`` is the
handle user feedback names.

Contract with the trainer side (online learning; agreed with the ``online`` work, changes go to
``/work/briefs/serve-contract-notes.md``):

* **A closed agent session becomes ONE `Rollout`** on ``rl.rollouts.v1`` with ``group_size=1``,
  ``group_index=0``, ``prompt_id`` = the session's task key (the client's ``metadata.task``, else the
  session id), ``rollout_id`` = the session id, ``token_ids`` / ``loss_mask`` / ``logprobs`` /
  ``token_versions`` laid out as the agent loop lays them out (loss mask 1 exactly on sampled ids;
  `rlbus.serve.sessions`), its sampling info, and ``metadata`` {``origin: "served"``, ``tenant``,
  ``session_id``, ``request_ids`` (comma-joined), ``history_edits``}.
* **A single completion recorded as a rollout** (header ``X-RL-Record-Rollout: 1`` or
  ``metadata.rl_record_rollout = "1"``) becomes such a Rollout too, ``rollout_id`` = the completion
  ``id``, ``prompt_id`` = ``metadata.task`` or the id — so feedback on the response id
  (`rlbus.producers.feedback`, source ``"user"``; give ``prompt_id`` = the ``X-RL-Prompt-Id`` header,
  since the id has no ``/<index>``) joins with it. With ``n`` > 1 the choices form one group:
  ``rollout_id`` ``<id>/<i>``, ``group_size`` n, ``prompt_id`` the id (a GRPO group; feedback then
  needs no prompt_id).
* **The reward of a session** (``POST /rl/sessions/{id}/reward``, body ``{"reward": number, "source"?:
  str, "components"?: {str: number}, "reason"?: str}``) is one `Reward` on ``rl.rewards.v1``, key
  ``rollout_id`` = the session id, ``source`` ``"user"`` unless the body says otherwise, ``reward_id``
  ``<session>:<source>:session``, published after the rollout. A bus that fails answers 503 with
  Retry-After and keeps the session open, so the client can retry.

Sessions are marked by ``X-RL-Session: <id>`` (or the ``user`` field, with ``user_sessions`` on). Admission
control (`rlbus.serve.admission`) may answer them 429 with ``Retry-After``; requests that are neither a
session nor recorded as a rollout are never refused for staleness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from rlbus.bus.base import Bus
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.engines.base import Engine, GenerationRequest, GenerationResult
from rlbus.envs.chat import ChatFormat
from rlbus.errors import ApiError, BusError
from rlbus.observe.metrics import (
    CONTENT_TYPE as METRICS_CONTENT_TYPE,
)
from rlbus.observe.metrics import (
    SERVE_HISTORY_EDITS,
    SERVE_LATENCY_SECONDS,
    SERVE_REQUESTS,
    SERVE_TOKENS,
    exposition,
)
from rlbus.observe.stats import percentile
from rlbus.schemas import Rollout, SamplingInfo, Served, ServedParams, TensorData, Turn
from rlbus.serve import api
from rlbus.serve.admission import Admission
from rlbus.serve.auth import Tenants
from rlbus.serve.prompt import Rendered, SampledTurn, render
from rlbus.serve.recorder import ServedRecorder
from rlbus.serve.sessions import Session, Sessions, session_reward

log = logging.getLogger("rlbus.serve.gateway")

MAX_BODY_BYTES = 1024 * 1024
SESSION_HEADER = "X-RL-Session"
RECORD_HEADER = "X-RL-Record-Rollout"
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclass(frozen=True)
class _Call:
    """One request as the gateway plays it: its context, its engine requests, how it is marked."""

    served_id: str
    request_id: str
    tenant: str
    request: api.ChatRequest
    context: Rendered
    engine_requests: list[GenerationRequest]
    tools: bool
    session: Session | None
    record_rollout: bool
    edits: list[str]
    started: float


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
    ) -> None:
        """``recorder`` writes ``rl.served.v1``, ``rollouts`` the rollouts of completions recorded as rollouts
        (both buffered), ``bus`` takes session rollouts and rewards (acknowledged before the 202). Without a
        ``bus`` sessions cannot be closed; without a recorder nothing is recorded. ``connect`` starts a bus
        that was not started (it may be down), before a session is published."""
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
        app.router.add_post("/rl/sessions/{session_id}/reward", self._session_reward)
        app.router.add_get("/rl/sessions/{session_id}", self._session_info)
        app.on_cleanup.append(self._shutdown_executor)
        return app

    async def run(self, stop: asyncio.Event, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until ``stop``; the recorders' drain tasks run alongside in one task group."""
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
            response = _error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            response = _error_response(ApiError(413, f"request body exceeds {self.max_body_bytes} bytes",
                                                code="request_too_large"))
        except web.HTTPNotFound:
            response = _error_response(ApiError(404, f"no route {request.method} {request.path}",
                                                code="unknown_url"))
        except web.HTTPMethodNotAllowed:
            response = _error_response(ApiError(405, f"{request.method} is not allowed on {request.path}",
                                                code="method_not_allowed"))
        except Exception as exc:  # never a bare traceback to a client; logged with the request
            log.exception("%s %s failed", request.method, request.path)
            response = _error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                                code="internal_error"))
        SERVE_REQUESTS.labels(route, str(response.status)).inc()
        return response

    # -- routes ------------------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return _json(200, {
            "ok": True, "model": self.model_name, "version": self.engine.policy_version, "served": self.served,
            "sessions_open": len(self.sessions), "history_edits": self.history_edits,
            "recorder": None if self.recorder is None else self.recorder.stats(),
            "admission_refused": {} if self.admission is None else dict(self.admission.refused),
        })

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=exposition(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        self.tenants.tenant_of(request.headers.get("Authorization"))
        return _json(200, {"object": "list", "data": [
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
        response = _json(200, body_out, headers=self._headers(call, results))
        self.own_seconds.append(time.perf_counter() - started - engine_s)
        return response

    async def _session_info(self, request: web.Request) -> web.Response:
        tenant = self.tenants.tenant_of(request.headers.get("Authorization"))
        session = self.sessions.owned(request.match_info["session_id"], tenant)
        seq = session.sequence
        return _json(200, {
            "session_id": session.session_id, "task": session.task, "turns": len(session.request_ids),
            "tokens": 0 if seq is None else len(seq.ids), "sampled_tokens": 0 if seq is None else sum(seq.mask),
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
        except json.JSONDecodeError as exc:
            raise api.bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
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
        log.info("session %s closed: rollout at %s[%d]@%d (%d tokens, %d sampled), reward %.3f (%s)",
                 session.session_id, at_rollout.topic, at_rollout.partition, at_rollout.offset,
                 rollout.token_ids.numel, int(sum(session.sequence.mask)) if session.sequence else 0,
                 reward.value, reward.source,
                 extra={"rollout_id": rollout.rollout_id, "topic": at_rollout.topic,
                        "partition": at_rollout.partition, "offset": at_rollout.offset})
        return _json(202, {
            "rollout_id": rollout.rollout_id, "prompt_id": rollout.prompt_id,
            "tokens": rollout.token_ids.numel, "sampled_tokens": int(rollout.loss_mask.to_numpy().sum()),
            "rollout": {"topic": at_rollout.topic, "partition": at_rollout.partition, "offset": at_rollout.offset},
            "reward": {"reward_id": reward.reward_id, "value": reward.value, "source": reward.source,
                       "topic": at_reward.topic, "partition": at_reward.partition, "offset": at_reward.offset},
        })

    # -- a completion ------------------------------------------------------------------------------------

    def _prepare(self, req: api.ChatRequest, http: web.Request, tenant: str, started: float) -> _Call:
        if req.model not in (self.model_name, self.model_id):
            raise ApiError(404, f"the model {req.model!r} does not exist; this gateway serves {self.model_name!r}",
                           param="model", code="model_not_found")
        served_id = api.new_id()
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
        if session_id is not None and session is None:
            session = self.sessions.open(session_id, tenant=tenant, task=metadata.get("task"))
        tools = api.tool_schemas(req)
        try:
            context = render(self.chat, api.internal_messages(req), tools=tools,
                             recorded=None if session is None else session.turns)
        except ValueError as exc:
            raise api.bad(f"this model's chat format cannot take tools: {exc}", "tools", "unsupported_value") from None
        context.add(self.chat.model_header)
        if context.edits and session is not None:
            session.edits += 1
            self.history_edits += 1
            SERVE_HISTORY_EDITS.inc()
            log.info("session %s: history edited (%s)", session.session_id, "; ".join(context.edits))
        room = self.max_context - len(context.ids)
        asked = req.max_completion_tokens or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise api.bad(f"the prompt is {len(context.ids)} tokens and max_tokens {asked or 1}; this model's "
                          f"context is {self.max_context}", "messages", "context_length_exceeded")
        max_tokens = min(asked or self.default_max_tokens, room)
        stops = tuple(api.stops_of(req))
        engine_requests = [
            GenerationRequest(
                prompt_ids=tuple(context.ids), max_new_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, stop=stops, stop_token_ids=self.chat.stop_ids,
                seed=None if req.seed is None else req.seed + i, request_id=f"{served_id}/{i}",
                top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            )
            for i in range(req.n)
        ]
        return _Call(served_id=served_id, request_id=request_id, tenant=tenant, request=req, context=context,
                     engine_requests=engine_requests, tools=tools is not None, session=session,
                     record_rollout=record_rollout, edits=context.edits, started=started)

    async def _generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), self.engine.generate, list(requests))

    def _choice(self, call: _Call, i: int, result: GenerationResult) -> tuple[dict[str, Any], str | None, list[Any]]:
        """(choice body, content, tool_calls) of one result."""
        content, calls = api.split_tool_calls(result.text, enabled=call.tools)
        finish = "tool_calls" if calls else result.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if call.request.logprobs:
            ids, lps = self._visible(result)
            top = result.extra.get("top_logprobs")
            logprobs = {"content": api.logprob_entries(ids, lps, None if top is None else top[: len(ids)],
                                                       self._piece), "refusal": None}
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}, content, calls

    def _visible(self, result: GenerationResult) -> tuple[list[int], list[float]]:
        """Sampled ids and log-probs without a final stop token (it is not part of the text)."""
        ids = list(result.token_ids)
        lps = [float(x) for x in result.logprobs.tolist()]
        if ids and ids[-1] in self.chat.stop_ids:
            ids, lps = ids[:-1], lps[:-1]
        return ids, lps

    def _piece(self, token: int) -> str:
        return self.chat.tokenizer.decode([token])

    def _finish(self, call: _Call, results: list[GenerationResult]) -> dict[str, Any]:
        """The response body; records every choice, updates the session, publishes recorded rollouts."""
        choices = []
        for i, result in enumerate(results):
            choice, content, calls = self._choice(call, i, result)
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
            "model": call.request.model, "system_fingerprint": self._fingerprint(results), "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "rl": self._rl_info(call, results),
        }

    def _rl_info(self, call: _Call, results: list[GenerationResult]) -> dict[str, Any]:
        return {
            "policy_versions": [sorted(set(r.policy_versions)) for r in results],
            "session_id": None if call.session is None else call.session.session_id,
            "history_edited": bool(call.edits), "history_edits": call.edits,
            "rollout_ids": self._rollout_ids(call) if call.record_rollout else [],
        }

    def _rollout_ids(self, call: _Call) -> list[str]:
        n = call.request.n
        return [call.served_id] if n == 1 else [f"{call.served_id}/{i}" for i in range(n)]

    def _prompt_id(self, call: _Call) -> str:
        if call.request.n > 1:
            return call.served_id
        return (call.request.metadata or {}).get("task") or call.served_id

    def _fingerprint(self, results: Sequence[GenerationResult]) -> str:
        return f"rlbus:{self.model_id}:v{_versions(results, 'v')}"

    def _headers(self, call: _Call, results: Sequence[GenerationResult] | None) -> dict[str, str]:
        version = _versions(results, "") if results else str(self.engine.policy_version)
        headers = {"X-Request-Id": call.request_id, "X-RL-Served-Id": call.served_id,
                   "X-RL-Policy-Version": version}
        if call.session is not None:
            headers[SESSION_HEADER] = call.session.session_id
            headers["X-RL-History"] = "edited" if call.edits else "ok"
            headers["X-RL-History-Edits"] = str(call.session.edits)
        if call.record_rollout:
            headers["X-RL-Rollout-Id"] = ",".join(self._rollout_ids(call))
            headers["X-RL-Prompt-Id"] = self._prompt_id(call)
        return headers

    def _record(self, call: _Call, i: int, result: GenerationResult, finish: str) -> None:
        if self.recorder is None:
            return
        req = call.request
        routed = result.routed_experts
        self.recorder.record(Served(
            served_id=call.served_id, choice_index=i, request_id=call.request_id, tenant=call.tenant,
            session_id="" if call.session is None else call.session.session_id, user=req.user or "",
            model_id=self.model_id, model_name=req.model, worker_id=self.worker_id, region=self.region,
            prompt_ids=_ints(result.prompt_ids), token_ids=_ints(result.token_ids),
            logprobs=TensorData.from_torch(result.logprobs.to("cpu").float()),
            token_versions=_ints(result.policy_versions),
            routed_experts=None if routed is None else TensorData.from_torch(routed.to("cpu").short()),
            sampling=_sampling(result), params=ServedParams(
                max_tokens=call.engine_requests[i].max_new_tokens, n=req.n, stop=list(api.stops_of(req)),
                seed=req.seed, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0,
                stream=bool(req.stream), tools=len(req.tools or ()), tool_choice=str(req.tool_choice or "auto")),
            finish_reason=finish, text=result.text, history_edited=bool(call.edits), created_at=self._clock(),
            latency_s=time.perf_counter() - call.started,
            metadata={k: v for k, v in (req.metadata or {}).items()},
        ))

    def _add_to_session(self, call: _Call, result: GenerationResult, content: str | None, calls: list[Any],
                        finish: str) -> None:
        assert call.session is not None
        routed = result.routed_experts
        turn = SampledTurn(
            key=api.turn_key(content, calls), prompt_ids=tuple(result.prompt_ids), token_ids=tuple(result.token_ids),
            logprobs=tuple(float(x) for x in result.logprobs.tolist()), versions=tuple(result.policy_versions),
            text=result.text, finish_reason=finish,
            routed_experts=None if routed is None else routed.to("cpu").numpy().astype(np.int16),
        )
        call.session.add_turn(call.context, turn, header_len=len(self.chat.model_header),
                              closing=list(self.chat.turn_closing(result.token_ids)), sampling=_sampling(result),
                              request_id=call.served_id, now=self._clock())

    def _publish_rollouts(self, call: _Call, results: list[GenerationResult], finishes: list[str]) -> None:
        if self.rollouts is None:
            return
        ids, prompt_id, n = self._rollout_ids(call), self._prompt_id(call), len(results)
        for i, result in enumerate(results):
            seq = call.context.copy()
            start = len(seq.ids) - len(self.chat.model_header)
            seq.add_sampled(list(result.token_ids), [float(x) for x in result.logprobs.tolist()],
                            list(result.policy_versions))
            seq.add(self.chat.turn_closing(result.token_ids))
            turns = [*seq.turns, Turn(role="assistant", text=result.text, start=start, end=len(seq.ids))]
            routed = result.routed_experts
            self.rollouts.record(Rollout(
                rollout_id=ids[i], prompt_id=prompt_id, group_index=i, group_size=n, model_id=self.model_id,
                worker_id=self.worker_id, region=self.region,
                token_ids=TensorData.from_numpy(np.asarray(seq.ids, dtype=np.int32)),
                loss_mask=TensorData.from_numpy(np.asarray(seq.mask, dtype=np.uint8)),
                logprobs=TensorData.from_numpy(np.asarray(seq.logprobs, dtype=np.float32)),
                token_versions=TensorData.from_numpy(np.asarray(seq.versions, dtype=np.int32)),
                routed_experts=None if routed is None else _routing_full(routed, len(seq.ids)),
                sampling=_sampling(result), turns=turns, finish_reason=finishes[i], created_at=self._clock(),
                metadata={"origin": "served", "tenant": call.tenant, "session_id": "", "request_ids": call.served_id,
                          **({"task": task} if (task := (call.request.metadata or {}).get("task")) else {})},
            ))

    # -- streaming ---------------------------------------------------------------------------------------

    async def _stream(self, http: web.Request, call: _Call) -> web.StreamResponse:
        """Server-sent events: a role chunk, text deltas as tokens are sampled, the finish, ``[DONE]``.

        A client that goes away mid-stream does not stop the generation or its recording: the tokens were
        sampled, so they are recorded (and join the session) like any completion."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

        def pusher(i: int) -> Callable[[int], None]:
            def push(token: int) -> None:  # on the generating thread
                loop.call_soon_threadsafe(queue.put_nowait, (i, token))

            return push

        requests = [replace(r, on_token=pusher(i)) for i, r in enumerate(call.engine_requests)]
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._headers(call, None)})
        await response.prepare(http)
        created = int(self._clock())
        gone = False

        async def send(data: bytes) -> None:
            nonlocal gone
            if gone:
                return
            try:
                await response.write(data)
            except (ConnectionError, RuntimeError):  # the client closed the connection
                gone = True

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {"id": call.served_id, "object": "chat.completion.chunk", "created": created,
                    "model": call.request.model, "system_fingerprint": f"rlbus:{self.model_id}:v{version[0]}",
                    "choices": choices, **extra}
            return b"data: " + msgspec.json.encode(body) + b"\n\n"

        version = [str(self.engine.policy_version)]
        n = len(requests)
        for i in range(n):
            await send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]))
        tokens: list[list[int]] = [[] for _ in range(n)]
        sent = [""] * n
        holds = [*call.engine_requests[0].stop, *(["<tool_call>"] if call.tools else [])]
        generation = asyncio.ensure_future(self._generate(requests))
        try:
            while not (generation.done() and queue.empty()):
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait([getter, generation], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                i, token = getter.result()
                tokens[i].append(token)
                visible = _safe_prefix(self.chat.decode(tokens[i]), holds)
                if len(visible) > len(sent[i]) and visible.startswith(sent[i]):
                    piece, sent[i] = visible[len(sent[i]):], visible
                    await send(chunk([{"index": i, "delta": {"content": piece}, "logprobs": None,
                                       "finish_reason": None}]))
            results = generation.result()
        except Exception as exc:  # headers are out: the failure becomes the stream's last event
            log.exception("streamed completion %s failed", call.served_id)
            error = exc if isinstance(exc, ApiError) else ApiError(
                500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
            await send(b"data: " + msgspec.json.encode(api.error_body(error)) + b"\n\n")
            if not gone:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write_eof()
            return response
        version[0] = _versions(results, "v")
        body = self._finish(call, results)
        for i, choice in enumerate(body["choices"]):
            content = choice["message"]["content"] or ""
            delta: dict[str, Any] = {}
            if content.startswith(sent[i]) and len(content) > len(sent[i]):
                delta["content"] = content[len(sent[i]):]
            if "tool_calls" in choice["message"]:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
            await send(chunk([{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                               "finish_reason": choice["finish_reason"]}]))
        if call.request.stream_options is not None and call.request.stream_options.include_usage:
            await send(chunk([], usage=body["usage"]))
        await send(b"data: [DONE]\n\n")
        if not gone:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write_eof()
        return response


def _safe_prefix(text: str, holds: Sequence[str]) -> str:
    """The part of a partial reply safe to stream: before a tool call, without a partial UTF-8 character
    or a tail that may still become a stop string (which the final text would cut)."""
    if "<tool_call>" in holds and "<tool_call>" in text:
        text = text[: text.index("<tool_call>")]
    text = text.rstrip("\ufffd")
    for s in holds:
        if s in text:
            text = text[: text.index(s)]
    keep = len(text)
    for s in holds:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]


def _versions(results: Sequence[GenerationResult] | None, prefix: str) -> str:
    versions = sorted({v for r in results or () for v in r.policy_versions})
    if not versions:
        return "?"
    lo, hi = versions[0], versions[-1]
    return f"{lo}" if lo == hi else f"{lo}-{prefix}{hi}"


def _ints(ids: Sequence[int]) -> TensorData:
    return TensorData.from_numpy(np.asarray(ids, dtype=np.int32))


def _sampling(result: GenerationResult) -> SamplingInfo:
    spec = result.logprob_spec
    return SamplingInfo(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                        logprob_kind="sampled" if spec.processed else "raw")


def _routing_full(routed: Any, total: int) -> TensorData:
    """[L, P + N - 1, k] of one call → [L, T, k] over the rollout (its last position, never fed: -1)."""
    array = routed.to("cpu").numpy().astype(np.int16)
    out = np.full((array.shape[0], total, array.shape[2]), -1, dtype=np.int16)
    out[:, : array.shape[1]] = array
    return TensorData.from_numpy(out)


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json",
                        headers=headers)


def _error_response(exc: ApiError) -> web.Response:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="rlbus"'
    return _json(exc.status, api.error_body(exc), headers)

"""Live user feedback: thumbs up or down on rollouts served in production, published as rewards.

Users are the last reward source docs/architecture.md §6 names: a signal on a served rollout becomes a
:class:`~rlbus.schemas.Reward` with ``source="user"`` on ``rl.rewards.v1`` (key ``rollout_id``), so the
trainer's join treats it like any verifier or judge reward and waits for it when its policy says so
(``RewardPolicy(sources=("verifier", "user"))``).

API (JSON; every route but ``/healthz`` needs ``Authorization: Bearer <token>``):

=================================  =====================================================================
``POST /v1/feedback``              one object (below) → 202 ``{reward_id, rollout_id, prompt_id, value,
                                   topic, partition, offset}``: where the reward landed on the log
``POST /v1/feedback:batch``        a JSON array of up to 500 objects → 202 ``{accepted, results: […]}``
``GET /healthz``                   200 ``{"ok": true}``; with the token also ``"published": n``
=================================  =====================================================================

Object fields: ``rollout_id`` (str, required), ``signal`` (``"up"`` | ``"down"``, required), ``score``
(number in **[0, 1]** or null), ``user`` (str or null), ``comment`` (str or null), ``prompt_id`` (str or
null: needed only when ``rollout_id`` is not the rollout worker's ``<prompt_id>/<index>``, because the
join groups rewards by prompt). Anything else — bad JSON, an unknown field, a wrong type, a value out of
range, a ``score`` that contradicts ``signal`` — is a 400 whose ``error`` names the field (``field``:
``score``, or ``[3].score`` in a batch) and nothing is published; a batch is validated whole first.
A bus that fails or does not acknowledge within ``publish_timeout_s`` is a 503 with ``Retry-After``,
listing under ``published`` the items of a batch that did land. Signals are published one by one, in
request order. A 503 after a timeout may still have published; retrying is safe, since the join keeps one
value per (rollout, source) and, with ``user`` set, the reward id repeats too.

Value. The scale is the verifiers' [0, 1] (exact match scores 1 or 0), so the sources' weights in
``RewardPolicy`` compare like with like: ``up`` → 1.0 and ``down`` → 0.0, or ``score`` when given, which
must agree with the signal (``up`` needs score ≥ 0.5, ``down`` score ≤ 0.5; 0.5 is neutral). Components
carry ``up`` (1/0) and ``score``; the comment becomes the reward's ``reason``.

Several users on one rollout. Each signal is its own reward, id ``<rollout>:user:<user>`` — so a client
retrying a request produces the same id — or ``<rollout>:user:anon-<random>`` without ``user``. The join
keeps one reward per (rollout, source): the *last* user reward buffered before the group completes wins
(rewards of one rollout share a partition, so "last" is log order), and signals arriving after the group
was trained are ignored by the trained-rollout ledger. Every individual signal stays on the log for
offline aggregation. Live feedback is sparse: a policy that waits for ``user`` relies on its
``timeout_s``/``min_group`` to release groups most users never rate.

The token comes from ``RLBUS_FEEDBACK_TOKEN`` or a file (``--token-file`` / ``RLBUS_FEEDBACK_TOKEN_FILE``),
never from the command line, where ``ps`` would show it; it is compared in constant time
(`rlbus.exposure.BearerAuth`). A refused request is a 401, logged at WARNING with its path and peer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from rlbus.bus.base import Bus
from rlbus.bus.topic import Topic
from rlbus.bus.topics import REWARDS
from rlbus.bus.types import RecordMetadata
from rlbus.config import secret_from
from rlbus.errors import BusError, ConfigError, FeedbackError, FeedbackRejected
from rlbus.exposure import BearerAuth, check_bind
from rlbus.schemas import Reward

log = logging.getLogger("rlbus.producers.feedback")

SOURCE = "user"
MAX_BATCH = 500
MAX_BODY_BYTES = 1024 * 1024
MIN_TOKEN_CHARS = 16
TOKEN_ENV = "RLBUS_FEEDBACK_TOKEN"
TOKEN_FILE_ENV = "RLBUS_FEEDBACK_TOKEN_FILE"

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class Feedback(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One user signal as the API accepts it."""

    #: The served rollout.
    rollout_id: Id
    #: Thumbs up or down.
    signal: Literal["up", "down"]
    #: Optional graded score in [0, 1]; must agree with ``signal`` (0.5 is neutral).
    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    #: Who rated; makes the reward id deterministic, so retries are idempotent.
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^\S+$")] | None = None
    #: Free text, kept as the reward's reason.
    comment: Annotated[str, msgspec.Meta(max_length=4000)] | None = None
    #: Only when ``rollout_id`` is not ``<prompt_id>/<index>``.
    prompt_id: Id | None = None


def parse(body: bytes, *, batch: bool) -> list[Feedback]:
    """Decode and validate a request body; raises FeedbackRejected naming the field."""
    try:
        items = msgspec.json.decode(body, type=list[Feedback] if batch else Feedback)
    except msgspec.ValidationError as exc:
        raise _rejected(str(exc), batch) from None
    except msgspec.DecodeError as exc:
        raise FeedbackRejected(f"body is not valid JSON: {exc}") from None
    items = items if isinstance(items, list) else [items]
    if batch and not 1 <= len(items) <= MAX_BATCH:
        raise FeedbackRejected(f"a batch holds 1 to {MAX_BATCH} items, not {len(items)}")
    for i, item in enumerate(items):
        where = f"[{i}]." if batch else ""
        if item.score is not None and (item.score < 0.5 if item.signal == "up" else item.score > 0.5):
            need = "≥ 0.5" if item.signal == "up" else "≤ 0.5"
            raise FeedbackRejected(
                f"{where}score: {item.score} contradicts signal {item.signal!r} (it needs score {need})",
                f"{where}score",
            )
        if item.prompt_id is None and prompt_of(item.rollout_id) is None:
            raise FeedbackRejected(
                f"{where}prompt_id: required because rollout_id {item.rollout_id!r} is not <prompt_id>/<index>",
                f"{where}prompt_id",
            )
    return items


def _rejected(text: str, batch: bool) -> FeedbackRejected:
    """msgspec's message (``… - at `$[2].score```) → one naming the field first."""
    match = re.search(r"\s*- at `\$(\S*)`$", text)
    path = match.group(1).lstrip(".") if match else ""
    problem = text[: match.start()] if match else text
    unknown = re.search(r"(?:unknown|missing required) field `([^`]*)`", problem)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    if not path:
        what = "a JSON array of feedback objects" if batch else "a JSON object"
        return FeedbackRejected(f"body must be {what}: {problem}")
    return FeedbackRejected(f"{path}: {problem}", path)


def prompt_of(rollout_id: str) -> str | None:
    """The prompt id in a rollout worker's rollout id ``<prompt_id>/<index>``; None for other forms."""
    prompt, sep, index = rollout_id.rpartition("/")
    return prompt if sep and prompt and index.isdigit() else None


def to_reward(item: Feedback, *, now: float) -> Reward:
    """The reward a signal becomes (see the module docstring for the mapping)."""
    up = item.signal == "up"
    value = item.score if item.score is not None else (1.0 if up else 0.0)
    components = {"up": 1.0 if up else 0.0}
    if item.score is not None:
        components["score"] = item.score
    who = item.user or f"anon-{uuid.uuid4().hex[:16]}"
    metadata: dict[str, str] = {"signal": item.signal}
    if item.user is not None:
        metadata["user"] = item.user
    prompt_id = item.prompt_id or prompt_of(item.rollout_id)
    assert prompt_id is not None, "parse() guarantees a prompt id"
    return Reward(
        reward_id=f"{item.rollout_id}:{SOURCE}:{who}",
        rollout_id=item.rollout_id,
        prompt_id=prompt_id,
        source=SOURCE,
        value=float(value),
        components=components,
        reason=item.comment or "",
        created_at=now,
        metadata=metadata,
    )


def load_token(*, file: Path | None = None, env: Mapping[str, str] = os.environ) -> str:
    """The bearer token: from ``file`` (or ``$RLBUS_FEEDBACK_TOKEN_FILE``), else ``$RLBUS_FEEDBACK_TOKEN``."""
    token = secret_from(None, file, TOKEN_ENV, field="feedback.token", file_env=TOKEN_FILE_ENV, environ=env)
    if not token or not token.strip():
        raise ConfigError("feedback.token", f"set {TOKEN_ENV} or give a token file ({TOKEN_FILE_ENV})")
    return token.strip()


def _json(status: int, body: Any, **headers: str) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json",
                        headers=headers)


class FeedbackServer:
    """The feedback API over a bus. ``topic`` is ``rl.rewards.v1`` except in tests; ``clock`` stamps
    ``created_at``; a publish not acknowledged within ``publish_timeout_s`` answers 503."""

    def __init__(
        self,
        *,
        bus: Bus,
        token: str,
        clock: Callable[[], float] = time.time,
        topic: Topic[Reward] = REWARDS,
        publish_timeout_s: float = 10.0,
    ) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError("feedback.token", f"must be at least {MIN_TOKEN_CHARS} characters")
        self._bus = bus
        self._auth = BearerAuth("feedback", token, open_paths={"/healthz"})
        self._clock = clock
        self._topic = topic
        self._publish_timeout_s = publish_timeout_s
        self.published = 0
        #: Where ``run`` listens once started: (host, port) — port 0 asks the OS for a free one.
        self.address: tuple[str, int] | None = None
        #: Set once ``run`` accepts connections.
        self.listening = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth.middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/healthz", self._health)
        app.router.add_post("/v1/feedback", self._one)
        app.router.add_post("/v1/feedback:batch", self._batch)
        return app

    async def run(self, stop: asyncio.Event, host: str = "127.0.0.1", port: int = 8471) -> None:
        check_bind(host, service="feedback", auth_configured=True)  # a token is required: never open
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            self.address = (host, int(runner.addresses[0][1]))
            self.listening.set()
            log.info("feedback API on http://%s:%d", *self.address)
            await stop.wait()
        finally:
            await runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        """Open, so a load balancer can probe it; the count only for the token's holder."""
        if not self._auth.accepts(request):
            return _json(200, {"ok": True})
        return _json(200, {"ok": True, "published": self.published})

    async def _one(self, request: web.Request) -> web.Response:
        return await self._accept(request, batch=False)

    async def _batch(self, request: web.Request) -> web.Response:
        return await self._accept(request, batch=True)

    async def _accept(self, request: web.Request, *, batch: bool) -> web.Response:
        try:
            items = parse(await request.read(), batch=batch)
        except FeedbackRejected as exc:
            return _json(400, {"error": str(exc), "field": exc.field})
        results: list[dict[str, Any]] = []
        for item in items:  # one by one, so signals on one rollout keep their order on the log
            reward = to_reward(item, now=self._clock())
            try:
                async with asyncio.timeout(self._publish_timeout_s):
                    meta = await self._bus.send(self._topic, reward)
            except (BusError, TimeoutError) as exc:
                log.warning("feedback for %s not published: %s", item.rollout_id, exc or type(exc).__name__)
                body = {"error": f"bus unavailable: {exc or 'no acknowledgement in time'}", "published": results}
                return _json(503, body, **{"Retry-After": "5"})
            self.published += 1
            results.append(_receipt(reward, meta))
        return _json(202, {"accepted": len(results), "results": results} if batch else results[0])


def _receipt(reward: Reward, meta: RecordMetadata) -> dict[str, Any]:
    return {
        "reward_id": reward.reward_id,
        "rollout_id": reward.rollout_id,
        "prompt_id": reward.prompt_id,
        "value": reward.value,
        "topic": meta.topic,
        "partition": meta.partition,
        "offset": meta.offset,
    }


async def send_feedback(url: str, token: str, item: Feedback, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """POST one signal to a running server (``rlbus feedback send``); returns the 202 body, raises
    FeedbackError with the server's message for any other status or when it cannot be reached."""
    import aiohttp

    body = msgspec.json.encode(msgspec.structs.asdict(item))
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(f"{url.rstrip('/')}/v1/feedback", data=body, headers=headers) as response,
        ):
            text = await response.text()
            if response.status != 202:
                raise FeedbackError(f"{response.status} {response.reason}: {text.strip()}")
            result: dict[str, Any] = msgspec.json.decode(text)
            return result
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise FeedbackError(f"cannot reach {url}: {exc or type(exc).__name__}") from None

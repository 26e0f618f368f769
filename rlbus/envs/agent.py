"""The multi-turn agent loop the rollout worker runs: generate, parse the action, run the tool, repeat.

One episode, step by step:

1. The context opens with BOS, the environment's system message (action format and tools) and the task.
   With native tool calls (a chat-template format) the tools' JSON schemas go into the system message
   as the template writes them (`rlbus.envs.chat.ChatFormat.system_text`); without a system message a
   template's default one is used.
2. The model samples a turn after the generation prompt (the ``assistant`` header), stopping on the
   format's action stop strings (``</tool>`` / ``</tool_call>``, ``</answer>``) and its end-of-turn token,
   at most ``max_new_tokens`` and never past the context or episode budget. Its tokens are the only
   trained ones (loss mask 1, behaviour log-prob and policy version kept). Whatever the template puts after
   a turn (ChatML's newline after ``<|im_end|>``, or the whole closing when the model was cut short) is
   appended masked. The context grows only by appending ids: sampled ids are never decoded and re-encoded.
3. The turn's first action is parsed (`ChatFormat.parse`: tagged tags, or native ``<tool_call>`` JSON):
   an answer ends the episode (``stop``); a tool call runs the tool (with a timeout) and appends its
   output as a ``tool`` message; a malformed or missing action appends an error message instead.
   Observations are masked.
4. The episode also ends after ``max_turns`` model turns (``max_turns``) or when no token budget is left
   (``length``). The observation after the last allowed turn is not appended.

Self-summarization: with ``summarize`` on, before a turn that could leave too little room for a summary,
the loop appends a request to summarize; the model writes ``<summary>…</summary>`` (trained, like any
model turn), and the episode continues in a fresh context — BOS, system message, task, then the summary
as a ``summary`` message — as a new segment (`Turn.segment`). Observations are cut so that the summary
request always still fits. The layout of the returned `Episode` is described in `rlbus.envs.episode`.

The engine's ``generate`` blocks, so every call runs in a worker thread (``asyncio.to_thread``); the event
loop stays free for other episodes, heartbeats and weight sync.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlbus.engines.base import Engine, GenerationRequest, GenerationResult
from rlbus.envs.base import Environment, Limits, Task, Tool
from rlbus.envs.chat import SUMMARY_STOPS, Answer, ChatFormat, Malformed, ToolCall, parse_summary
from rlbus.envs.episode import Episode
from rlbus.envs.tool_calls import CallHelp, tool_schema
from rlbus.errors import ToolError
from rlbus.schemas import Prompt, SamplingInfo, Turn

SUMMARY_REQUEST = "Context full. Summarize what you know and still need as <summary>...</summary>."


class AgentLoop:
    """Runs episodes against one engine; holds no per-episode state, so one loop serves many episodes."""

    def __init__(
        self,
        *,
        engine: Engine,
        chat: ChatFormat,
        limits: Limits,
        sampling: SamplingInfo | None = None,
        summary_request: str = SUMMARY_REQUEST,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.limits = limits
        self.sampling = sampling or SamplingInfo()
        self.summary_request = summary_request
        self.clock = clock

    async def run(
        self,
        *,
        task: str,
        tools: Mapping[str, Tool] | None = None,
        system: str | None = None,
        episode_id: str | None = None,
    ) -> Episode:
        """One episode on ``task``; see the module docstring for the steps and finish reasons."""
        run = _Run(self, dict(tools or {}), system, task)
        start = self.clock()
        finish = await run.play()
        run.timings["total"] = self.clock() - start
        return run.episode(episode_id or uuid.uuid4().hex, finish)


class _Run:
    """The state of one episode while it is played."""

    def __init__(self, loop: AgentLoop, tools: dict[str, Tool], system: str | None, task: str) -> None:
        self.loop, self.chat, self.limits = loop, loop.chat, loop.limits
        self.tools, self.task = tools, task
        schemas = (
            [tool_schema(t.name, t.description, t.parameters) for t in tools.values()]
            if self.chat.actions == "native"
            else None
        )
        self.structured = frozenset(t.name for t in tools.values() if t.parameters is not None)
        self.hint = CallHelp.of(schemas, [t.name for t in tools.values() if t.final]) if schemas is not None else None
        self.system = self.chat.system_text(system, schemas)
        self.seq = _Sequence(loop.chat)
        self.answer: str | None = None
        self.sampling = loop.sampling
        self.timings = {"generate": 0.0, "env": 0.0}
        self.stats = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "malformed": 0, "segments": 1}
        self.final_output: str | None = None
        """Set by a successful call of a ``final`` tool (``submit``): the episode ends with it as the answer."""
        self.turns_in_segment = 0
        self._open_segment(summary=None)

    async def play(self) -> str:
        while self.stats["turns"] < self.limits.max_turns:
            if self._should_summarize():
                if not await self._summarize():
                    return "length"
                continue
            budget = min(self.limits.max_new_tokens, *self._turn_rooms())
            if budget < 1:
                return "length"
            action = self.chat.parse(await self._model_turn(budget, self.chat.action_stops), self.structured, self.hint)
            self.stats["turns"] += 1
            self.turns_in_segment += 1
            if isinstance(action, Answer):
                self.answer = action.text
                return "stop"
            observation = await self._observe(action)
            if self.final_output is not None:
                self.answer = self.final_output
                return "stop"
            if self.stats["turns"] < self.limits.max_turns:
                self._add_observation(observation)
        return "max_turns"

    def episode(self, episode_id: str, finish: str) -> Episode:
        return Episode(
            episode_id=episode_id,
            token_ids=self.seq.ids,
            loss_mask=self.seq.mask,
            logprobs=self.seq.logprobs,
            token_versions=self.seq.versions,
            turns=self.seq.turns,
            finish_reason=finish,
            answer=self.answer,
            routed_experts=self.seq.routing.assemble(len(self.seq.ids)),
            sampling=self.sampling,
            timings=self.timings,
            stats=self.stats,
        )

    def _rooms(self) -> tuple[int, int]:
        """Tokens left (in this context, in the whole episode)."""
        return self.limits.context_tokens - len(self.seq.context), self.limits.max_total_tokens - len(self.seq.ids)

    def _turn_rooms(self) -> tuple[int, int]:
        """Tokens a model turn may sample besides its header and closing (in this context, in the episode)."""
        frame = self.chat.turn_reserve()
        context, total = self._rooms()
        return context - frame, total - frame

    def _summary_reserve(self) -> int:
        request = self.chat.framing("user") + len(self.chat.encode(self.loop.summary_request))
        return request + self.chat.turn_reserve() + self.limits.summary_max_tokens

    def _should_summarize(self) -> bool:
        if not self.limits.summarize or self.turns_in_segment == 0:
            return False
        if self.stats["segments"] >= self.limits.max_segments:
            return False
        context, _ = self._turn_rooms()
        return context - self.limits.max_new_tokens < self._summary_reserve()

    async def _summarize(self) -> bool:
        """Ask for a summary and restart from it in a new segment; False if no budget was left for it.

        The summary is paid for twice — sampled here, copied into the new context — so it gets at most
        half of what the episode has left after the request and the new segment's opening.
        """
        request = self.chat.framing("user") + len(self.chat.encode(self.loop.summary_request))
        opening = self._opening_cost()
        context, total = self._turn_rooms()
        budget = min(
            self.limits.summary_max_tokens,
            context - request,
            (total - request - opening) // 2,
            self.limits.context_tokens - opening,
        )
        if budget < 1:
            return False
        self.seq.add_message("user", self.loop.summary_request)
        summary = parse_summary(await self._model_turn(budget, SUMMARY_STOPS))
        self.stats["segments"] += 1
        self._open_segment(summary=self.chat.encode(summary)[:budget])
        return True

    def _opening_cost(self) -> int:
        """Tokens a summarized segment needs besides the summary: BOS, system, task, framing, one token."""
        system = 0 if self.system is None else self.chat.framing("system") + len(self.chat.encode(self.system))
        task = self.chat.framing("user") + len(self.chat.encode(self.task))
        frames = self.chat.framing("summary") + self.chat.turn_reserve()
        return len(self.chat.bos) + system + task + frames + 1

    def _open_segment(self, *, summary: list[int] | None) -> None:
        self.seq.new_segment()
        self.turns_in_segment = 0
        if self.system is not None:
            self.seq.add_message("system", self.system)
        self.seq.add_message("user", self.task)
        if summary is not None:
            self.seq.add_message("summary", self.chat.tokenizer.decode(summary), ids=summary)

    async def _model_turn(self, budget: int, stops: tuple[str, ...]) -> str:
        header = self.chat.model_header
        request = GenerationRequest(
            prompt_ids=(*self.seq.context, *header),
            max_new_tokens=budget,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            stop=stops,
            stop_token_ids=self.chat.stop_ids,
        )
        start = self.loop.clock()
        [result] = await asyncio.to_thread(self.loop.engine.generate, [request])
        self.timings["generate"] += self.loop.clock() - start
        self.sampling = _sampling_of(request, result)
        text = self.chat.decode(result.token_ids)
        self.seq.add_model_turn(header, result, text, closing=self.chat.turn_closing(result.token_ids))
        return text

    async def _observe(self, action: ToolCall | Malformed) -> str:
        if isinstance(action, Malformed):
            self.stats["malformed"] += 1
            return f"error: {action.problem}"
        self.stats["tool_calls"] += 1
        start = self.loop.clock()
        output, ok = await self._call_tool(action)
        self.timings["env"] += self.loop.clock() - start
        self.stats["tool_errors"] += 0 if ok else 1
        return output

    async def _call_tool(self, call: ToolCall) -> tuple[str, bool]:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"error: unknown tool {call.name!r} (tools: {known})", False
        try:
            async with asyncio.timeout(self.limits.tool_timeout_s):
                output = await tool.run(call.argument)
        except ToolError as exc:
            return f"error: {exc}", False
        except TimeoutError:
            return f"error: tool {call.name!r} timed out after {self.limits.tool_timeout_s:g}s", False
        if tool.final:
            self.final_output = output
        return output, True

    def _add_observation(self, text: str) -> None:
        """Append tool output, cut to the observation limit and so that a summary request still fits."""
        context, total = self._rooms()
        reserve = self._summary_reserve() if self.limits.summarize else 0
        room = min(context - reserve, total) - self.chat.framing("tool")
        if room < 1:
            return  # not even one token of it fits; the next iteration summarizes or ends with "length"
        limit = min(self.limits.max_observation_tokens, room)
        ids = self.chat.encode(text)[:limit]
        self.seq.add_message("tool", self.chat.tokenizer.decode(ids), ids=ids)


def _sampling_of(request: GenerationRequest, result: GenerationResult) -> SamplingInfo:
    spec = result.logprob_spec
    return SamplingInfo(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        logprob_kind="sampled" if spec.processed else "raw",
    )


class _Sequence:
    """The flat token sequence of an episode and its token-aligned records."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[Turn] = []
        self.segment = -1
        self.segment_start = 0
        self.routing = _Routing()

    @property
    def context(self) -> list[int]:
        return self.ids[self.segment_start :]

    def new_segment(self) -> None:
        self.segment += 1
        self.segment_start = len(self.ids)
        self._extend(self.chat.bos)

    def add_message(self, role: str, text: str, *, ids: list[int] | None = None) -> None:
        """An environment message (masked): header, text, closing; the segment's BOS belongs to its first turn."""
        first = not any(t.segment == self.segment for t in self.turns)
        start = self.segment_start if first else len(self.ids)
        self._extend(self.chat.header(role))
        self._extend(self.chat.encode(text) if ids is None else ids)
        self._extend(self.chat.closing(role))
        self.turns.append(Turn(role=role, text=text, start=start, end=len(self.ids), segment=self.segment))

    def add_model_turn(
        self, header: Sequence[int], result: GenerationResult, text: str, *, closing: Sequence[int] = ()
    ) -> None:
        """The header (masked), the sampled ids exactly as the engine returned them, the closing (masked)."""
        tokens = list(result.token_ids)
        logprobs = _as_floats(result.logprobs)
        versions = list(result.policy_versions)
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"engine result has {len(tokens)} tokens, {len(logprobs)} log-probs, {len(versions)} versions"
            )
        start = len(self.ids)
        self._extend(header)
        self.routing.record(self.segment_start, len(self.context), len(tokens), result.routed_experts)
        self.ids += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions
        self._extend(closing)
        self.turns.append(Turn(role="assistant", text=text, start=start, end=len(self.ids), segment=self.segment))

    def _extend(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


def _as_floats(logprobs: Any) -> list[float]:
    if isinstance(logprobs, torch.Tensor):
        return [float(x) for x in logprobs.detach().to("cpu", torch.float32).reshape(-1).tolist()]
    return [float(x) for x in logprobs]


@dataclass
class _Call:
    segment_start: int
    prompt_len: int
    generated: int
    experts: np.ndarray[Any, Any]
    """[L, prompt_len + generated - 1, k] experts of each input position of the call."""


@dataclass
class _Routing:
    """Routed experts per generation call, merged into one [L, T, k] array (rule: rlbus.envs.episode)."""

    calls: list[_Call] = field(default_factory=list)

    def record(self, segment_start: int, prompt_len: int, generated: int, experts: Any) -> None:
        if experts is None:
            return
        array = experts.detach().to("cpu").numpy() if isinstance(experts, torch.Tensor) else np.asarray(experts)
        expected = prompt_len + generated - 1
        if array.ndim != 3 or array.shape[1] != expected:
            raise ValueError(f"routed_experts has shape {array.shape}; expected [L, {expected}, k]")
        self.calls.append(_Call(segment_start, prompt_len, generated, array))

    def assemble(self, total: int) -> np.ndarray[Any, Any] | None:
        if not self.calls:
            return None
        shapes = {(c.experts.shape[0], c.experts.shape[2]) for c in self.calls}
        if len(shapes) != 1:
            raise ValueError(f"generation calls disagree on routed_experts [L, k]: {sorted(shapes)}")
        layers, k = shapes.pop()
        out = np.full((layers, total, k), -1, dtype=np.int16)
        for c in self.calls:  # every position a call read; later calls overwrite earlier ones
            s = c.segment_start
            out[:, s : s + c.experts.shape[1]] = c.experts
        for c in self.calls:  # the positions whose next token this call sampled win
            s, own = c.segment_start, slice(c.prompt_len - 1, c.prompt_len + c.generated - 1)
            out[:, s + own.start : s + own.stop] = c.experts[:, own]
        return out


async def run_episode(
    env: Environment[Any],
    prompt: Prompt,
    *,
    engine: Engine,
    chat: ChatFormat,
    sampling: SamplingInfo | None = None,
    episode_id: str | None = None,
) -> Episode:
    """Play ``prompt`` in its environment: open the world, run the loop with its tools, close the world."""
    async with env.world(prompt) as world:
        loop = AgentLoop(engine=engine, chat=chat, limits=env.limits(), sampling=sampling)
        episode = await loop.run(
            task=prompt.text,
            tools=world.tools,
            system=env.instructions(world, native_tools=chat.actions == "native"),
            episode_id=episode_id,
        )
        if world.result is not None:
            episode.metadata.update(await world.result())
        return episode


async def reference_episode(task: Task[Any], prompt: Prompt, *, chat: ChatFormat) -> Episode:
    """The task's reference solution played through the real harness: warm-start (SFT) data.

    The model turns come from ``task.reference_turns``; observations come from the live world, so the
    episode has exactly the token layout a policy rollout would have.
    """
    from rlbus.envs.scripted import ScriptedEngine

    engine = ScriptedEngine(task.reference_turns(prompt), tokenizer=chat.tokenizer)
    return await run_episode(task, prompt, engine=engine, chat=chat, sampling=SamplingInfo(temperature=0.0))

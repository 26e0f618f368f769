"""The agent loop against a scripted fake engine: actions, observations, budgets, summaries, alignment."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np
import pytest
import torch

from rlbus.engines.base import GenerationRequest, GenerationResult, LogprobSpec
from rlbus.envs.agent import AgentLoop, run_episode
from rlbus.envs.base import Limits, Tool, make_env, registered_envs
from rlbus.envs.chat import Answer, ChatFormat, Malformed, ToolCall, parse_action, parse_summary
from rlbus.envs.episode import Episode, episode_to_rollout, rollout_to_episode, segment_spans
from rlbus.errors import ConfigError, ToolError
from rlbus.models.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from rlbus.schemas import Codec, Prompt, Rollout

TOK = ByteTokenizer()
CHAT = ChatFormat.for_byte_tokenizer(TOK)
USER, ASSISTANT, TOOL, SUMMARY = (
    TOK.token_id(t) for t in ("<|user|>", "<|assistant|>", "<|tool_result|>", "<|summary|>")
)


class FakeEngine:
    """Returns scripted turns (+EOS) with distinct fake log-probs, versions and routed experts per call."""

    def __init__(self, turns: Iterable[str], *, layers: int = 0, k: int = 2, version_step: int = 0) -> None:
        self.turns = deque(turns)
        self.layers, self.k, self.version_step = layers, k, version_step
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []
        self.threads: list[int] = []
        self._version = 5

    @property
    def policy_version(self) -> int:
        return self._version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._version = version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.threads.append(threading.get_ident())
        return [self._one(r) for r in requests]

    def _one(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        call = len(self.requests)
        ids = [*TOK.encode(self.turns.popleft()), EOS_ID][: request.max_new_tokens]
        n = len(ids)
        routed = None
        if self.layers:
            routed = torch.full((self.layers, len(request.prompt_ids) + n - 1, self.k), call, dtype=torch.int64)
        result = GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=tuple(ids),
            logprobs=torch.tensor([-(call + i / 1000) for i in range(n)], dtype=torch.float32),
            policy_versions=(self._version,) * n,
            text=TOK.decode(ids, skip_special=True),
            finish_reason="stop" if ids[-1] == EOS_ID else "length",
            logprob_spec=LogprobSpec(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k),
            routed_experts=routed,
        )
        self._version += self.version_step
        self.results.append(result)
        return result


def loop(engine: FakeEngine, **limits: object) -> AgentLoop:
    return AgentLoop(engine=engine, chat=CHAT, limits=Limits(**limits), summary_request="sum")  # type: ignore[arg-type]


def calc_tool(calls: list[str]) -> Tool:
    async def run(arg: str) -> str:
        calls.append(arg)
        a, b = arg.split("+")
        return str(int(a) + int(b))

    return Tool("calc", "adds two integers", run)


def assert_aligned(ep: Episode, engine: FakeEngine) -> None:
    """Mask 1 exactly on sampled tokens; their log-probs and versions are the engine's, others 0 / -1."""
    model_turns = [t for t in ep.turns if t.role == "assistant"]
    assert len(model_turns) == len(engine.results)
    expected_mask = np.zeros(len(ep.token_ids), dtype=int)
    for turn, result in zip(model_turns, engine.results, strict=True):
        lo = turn.start + 1  # after the assistant header
        assert ep.token_ids[turn.start] == ASSISTANT
        assert tuple(ep.token_ids[lo : turn.end]) == result.token_ids
        assert ep.logprobs[lo : turn.end] == pytest.approx(result.logprobs.tolist())
        assert tuple(ep.token_versions[lo : turn.end]) == result.policy_versions
        expected_mask[lo : turn.end] = 1
    assert ep.loss_mask == expected_mask.tolist()
    off = expected_mask == 0
    assert all(np.asarray(ep.logprobs)[off] == 0.0)
    assert all(np.asarray(ep.token_versions)[off] == -1)


def assert_tiled(ep: Episode) -> None:
    """Turns cover [0, T) exactly, in order."""
    assert ep.turns[0].start == 0 and ep.turns[-1].end == len(ep.token_ids)
    for a, b in zip(ep.turns, ep.turns[1:], strict=False):
        assert a.end == b.start


async def test_direct_answer_layout() -> None:
    engine = FakeEngine(["<answer>5</answer>"])
    ep = await loop(engine, max_turns=3).run(task="2+3=")
    assert ep.finish_reason == "stop" and ep.answer == "5"
    assert ep.token_ids == [BOS_ID, USER, *TOK.encode("2+3="), ASSISTANT, *TOK.encode("<answer>5</answer>"), EOS_ID]
    assert [t.role for t in ep.turns] == ["user", "assistant"]
    assert_aligned(ep, engine)
    assert_tiled(ep)
    request = engine.requests[0]
    assert request.prompt_ids == (BOS_ID, USER, *TOK.encode("2+3="), ASSISTANT)
    assert "</answer>" in request.stop and EOS_ID in request.stop_token_ids
    assert set(ep.timings) >= {"generate", "env", "total"}


async def test_tool_call_then_answer() -> None:
    calls: list[str] = []
    engine = FakeEngine(['<tool name="calc">2+3</tool>', "<answer>5</answer>"])
    ep = await loop(engine, max_turns=4).run(task="add", tools={"calc": calc_tool(calls)}, system="be brief")
    assert calls == ["2+3"]
    assert [t.role for t in ep.turns] == ["system", "user", "assistant", "tool", "assistant"]
    tool_turn = ep.turns[3]
    assert tool_turn.text == "5"
    assert ep.token_ids[tool_turn.start : tool_turn.end] == [TOOL, *TOK.encode("5")]
    assert engine.requests[1].prompt_ids == tuple(ep.token_ids[: ep.turns[4].start + 1])
    assert ep.stats["tool_calls"] == 1 and ep.stats["tool_errors"] == 0
    assert_aligned(ep, engine)
    assert_tiled(ep)


async def test_malformed_and_unknown_calls_become_error_observations() -> None:
    engine = FakeEngine(['<tool name="calc">2+3', '<tool name="nope">x</tool>', "just talk", "<answer>5</answer>"])
    ep = await loop(engine, max_turns=5).run(task="t", tools={"calc": calc_tool([])})
    observations = [t.text for t in ep.turns if t.role == "tool"]
    assert observations[0].startswith("error: malformed tool call")
    assert observations[1].startswith("error: unknown tool 'nope'") and "calc" in observations[1]
    assert observations[2].startswith("error: no action")
    assert ep.finish_reason == "stop" and ep.answer == "5"
    assert ep.stats == {"turns": 4, "tool_calls": 1, "tool_errors": 1, "malformed": 2, "segments": 1}
    assert_aligned(ep, engine)


async def test_tool_errors_and_timeouts_are_observations() -> None:
    async def failing(_: str) -> str:
        raise ToolError("bad input")

    async def slow(_: str) -> str:
        await asyncio.sleep(5)
        return "late"

    tools = {"fail": Tool("fail", "", failing), "slow": Tool("slow", "", slow)}
    engine = FakeEngine(['<tool name="fail">x</tool>', '<tool name="slow">x</tool>', "<answer>a</answer>"])
    ep = await loop(engine, max_turns=3, tool_timeout_s=0.05).run(task="t", tools=tools)
    observations = [t.text for t in ep.turns if t.role == "tool"]
    assert observations == ["error: bad input", "error: tool 'slow' timed out after 0.05s"]
    assert ep.stats["tool_errors"] == 2


async def test_max_turns_ends_without_trailing_observation() -> None:
    calls: list[str] = []
    engine = FakeEngine(['<tool name="calc">1+1</tool>'] * 2)
    ep = await loop(engine, max_turns=2).run(task="t", tools={"calc": calc_tool(calls)})
    assert ep.finish_reason == "max_turns" and ep.answer is None
    assert [t.role for t in ep.turns] == ["user", "assistant", "tool", "assistant"]
    assert calls == ["1+1", "1+1"]  # the last call still runs (it may have side effects) but is not shown
    assert_aligned(ep, engine)


async def test_token_budget_ends_with_length() -> None:
    engine = FakeEngine(['<tool name="calc">1+1</tool>'] * 10)
    ep = await loop(engine, max_turns=10, max_new_tokens=32, max_total_tokens=80).run(
        task="t", tools={"calc": calc_tool([])}
    )
    assert ep.finish_reason == "length"
    assert len(ep.token_ids) <= 80
    budgets = [r.max_new_tokens for r in engine.requests]
    assert budgets[:2] == [32, 32] and budgets[-1] < 32  # the last turn got what was left
    assert_aligned(ep, engine)


async def test_observation_is_cut_to_its_limit() -> None:
    async def dump(_: str) -> str:
        return "y" * 1000

    engine = FakeEngine(['<tool name="dump">x</tool>', "<answer>a</answer>"])
    ep = await loop(engine, max_turns=2, max_observation_tokens=10).run(
        task="t", tools={"dump": Tool("dump", "", dump)}
    )
    tool_turn = next(t for t in ep.turns if t.role == "tool")
    assert tool_turn.text == "y" * 10 and tool_turn.end - tool_turn.start == 11


async def test_generate_runs_off_the_event_loop() -> None:
    engine = FakeEngine(["<answer>1</answer>"])
    await loop(engine).run(task="t")
    assert engine.threads and threading.get_ident() not in engine.threads


async def test_summarization_continues_in_a_fresh_segment() -> None:
    calls: list[str] = []
    script = [
        '<tool name="calc">1+2</tool>',
        '<tool name="calc">3+4</tool>',
        "<summary>v=3,7</summary>",
        "<answer>10</answer>",
    ]
    engine = FakeEngine(script)
    limits = {"max_turns": 5, "max_new_tokens": 30, "context_tokens": 120, "summarize": True, "summary_max_tokens": 32}
    ep = await loop(engine, **limits).run(task="task", tools={"calc": calc_tool(calls)})
    assert ep.finish_reason == "stop" and ep.answer == "10"
    assert ep.stats["segments"] == 2 and ep.stats["turns"] == 3  # the summary turn is not an action
    roles = [(t.role, t.segment) for t in ep.turns]
    assert roles == [
        ("user", 0), ("assistant", 0), ("tool", 0), ("assistant", 0), ("tool", 0),
        ("user", 0), ("assistant", 0),  # summary request and the model's summary (trained)
        ("user", 1), ("summary", 1), ("assistant", 1),
    ]  # fmt: skip
    assert ep.turns[5].text == "sum"
    # The last call saw only the fresh context: BOS, task, summary — nothing of segment 0.
    fresh = (BOS_ID, USER, *TOK.encode("task"), SUMMARY, *TOK.encode("v=3,7"), ASSISTANT)
    assert engine.requests[-1].prompt_ids == fresh
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 120 for r in engine.requests)
    spans = segment_spans(ep.turns)
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == len(ep.token_ids)
    assert sum(ep.loss_mask[spans[0][0] : spans[0][1]]) > 0 and sum(ep.loss_mask[spans[1][0] : spans[1][1]]) > 0
    assert_aligned(ep, engine)
    assert_tiled(ep)


async def test_without_summarization_a_full_context_ends_the_episode() -> None:
    engine = FakeEngine(['<tool name="calc">1+2</tool>'] * 5)
    limits = {"max_turns": 5, "max_new_tokens": 30, "context_tokens": 80}
    ep = await loop(engine, **limits).run(task="task", tools={"calc": calc_tool([])})
    assert ep.finish_reason == "length" and ep.stats["segments"] == 1
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 80 for r in engine.requests)


async def test_summaries_stop_at_max_segments() -> None:
    engine = FakeEngine(['<tool name="calc">1+2</tool>', "<summary>s</summary>"] + ['<tool name="calc">1+2</tool>'] * 6)
    limits = {"max_turns": 8, "max_new_tokens": 30, "context_tokens": 110, "summarize": True,
              "summary_max_tokens": 24, "max_segments": 2}  # fmt: skip
    ep = await loop(engine, **limits).run(task="task", tools={"calc": calc_tool([])})
    assert ep.stats["segments"] == 2 and ep.finish_reason == "length"


async def test_routed_experts_keep_the_sampling_call_per_position() -> None:
    engine = FakeEngine(['<tool name="calc">1+2</tool>', "<answer>3</answer>"], layers=2, k=2)
    ep = await loop(engine, max_turns=2).run(task="t", tools={"calc": calc_tool([])})
    routed = ep.routed_experts
    assert routed is not None and routed.shape == (2, len(ep.token_ids), 2) and routed.dtype == np.int16
    p1, n1 = len(engine.requests[0].prompt_ids), len(engine.results[0].token_ids)
    p2, n2 = len(engine.requests[1].prompt_ids), len(engine.results[1].token_ids)
    per_position = routed[0, :, 0]
    assert (per_position[: p1 - 1] == 2).all()  # read by both calls: the latest wins
    assert (per_position[p1 - 1 : p1 + n1 - 1] == 1).all()  # positions whose next token call 1 sampled
    assert (per_position[p1 + n1 - 1 : p2 + n2 - 1] == 2).all()
    assert per_position[-1] == -1  # the last sampled token is never fed to the model
    assert p2 + n2 == len(ep.token_ids)


async def test_engine_result_with_misaligned_logprobs_is_rejected() -> None:
    class Broken(FakeEngine):
        def _one(self, request: GenerationRequest) -> GenerationResult:
            r = super()._one(request)
            return GenerationResult(r.request_id, r.prompt_ids, r.token_ids, r.logprobs[:-1], r.policy_versions,
                                    r.text, r.finish_reason, r.logprob_spec)  # fmt: skip

    with pytest.raises(ValueError, match="log-probs"):
        await loop(Broken(["<answer>1</answer>"])).run(task="t")


async def test_rollout_round_trip_through_the_wire_format() -> None:
    engine = FakeEngine(['<tool name="calc">1+2</tool>', "<answer>3</answer>"], layers=2, version_step=1)
    ep = await loop(engine, max_turns=2).run(task="t", tools={"calc": calc_tool([])}, episode_id="ep-1")
    prompt = Prompt(prompt_id="p-1", env="arith", text="t", group_size=4)
    rollout = episode_to_rollout(ep, prompt=prompt, group_index=2, worker_id="w")
    assert rollout.rollout_id == "ep-1" and rollout.group_size == 4 and rollout.metadata["answer"] == "3"
    codec = Codec(Rollout)
    back = rollout_to_episode(codec.decode(codec.encode(rollout)))
    assert back.token_ids == ep.token_ids and back.loss_mask == ep.loss_mask
    assert back.logprobs == pytest.approx(ep.logprobs) and back.token_versions == ep.token_versions
    assert back.turns == ep.turns and back.answer == "3" and back.stats == ep.stats
    assert back.routed_experts is not None and ep.routed_experts is not None
    assert (back.routed_experts == ep.routed_experts).all()
    assert set(ep.token_versions) == {-1, 5, 6}  # a weight swap between turns shows per token


async def test_run_episode_uses_the_environment_world_and_instructions() -> None:
    prompt = Prompt(prompt_id="p", env="kv", text="Find it from abc.", reference="42",
                    env_config={"table": {"abc": "42"}, "start": "abc"})  # fmt: skip
    env = make_env(prompt.env, prompt.env_config)
    engine = FakeEngine(['<tool name="get">abc</tool>', "<answer>42</answer>"])
    ep = await run_episode(env, prompt, engine=engine, chat=CHAT)
    assert ep.turns[0].role == "system" and "get" in ep.turns[0].text
    assert [t.text for t in ep.turns if t.role == "tool"] == ["42"]
    assert (await env.score(ep, prompt)).value == 1.0


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ('<tool name="calc">2+3</tool>', ToolCall("calc", "2+3")),
        ('think <tool name = "a b" >\n x \n</tool> <answer>1</answer>', ToolCall("a b", "x")),
        ('<answer> 5 </answer><tool name="c">1</tool>', Answer("5")),
        ("<answer>multi\nline</answer>", Answer("multi\nline")),
        ('<tool name="calc">2+3', Malformed('malformed tool call: write <tool name="NAME">INPUT</tool>')),
        ("<tool>2+3</tool>", Malformed('malformed tool call: write <tool name="NAME">INPUT</tool>')),
        ("<answer>5", Malformed("malformed answer: write <answer>ANSWER</answer>")),
    ],
)
def test_parse_action(text: str, action: object) -> None:
    assert parse_action(text) == action


def test_parse_summary() -> None:
    assert parse_summary("x <summary> a b </summary> y") == "a b"
    assert parse_summary("<summary>cut short") == "cut short"


def test_make_env_validates_config_as_data() -> None:
    assert {"arith", "strings", "kv", "python_fn"} <= set(registered_envs())
    with pytest.raises(ConfigError) as unknown:
        make_env("nope", {})
    assert unknown.value.field == "env" and "arith" in str(unknown.value)
    with pytest.raises(ConfigError) as bad:
        make_env("arith", {"max_turns": 0})
    assert bad.value.field == "env_config.max_turns"
    with pytest.raises(ConfigError) as extra:
        make_env("arith", {"digitz": 2})
    assert extra.value.field == "env_config.digitz"
    with pytest.raises(ConfigError) as typed:
        make_env("kv", {"table": {"a": 1}})
    assert typed.value.field.startswith("env_config.table")


def test_reward_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys; import rlbus.envs.base, rlbus.envs.episode, rlbus.rewards.judge, rlbus.rewards.function,"
        " rlbus.sandbox, rlbus.envs.tasks, rlbus.envs.tasks.jsonl; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("summarize", [False, True])
async def test_budgets_hold_for_every_context_and_episode_size(summarize: bool) -> None:
    """Whatever the sizes, no request overflows its context and no episode overflows its budget."""
    segments = set()
    for context in range(40, 161, 24):
        for total in (50, 90, 200):
            script = ['<tool name="calc">1+2</tool>', "<summary>s</summary>"] * 6
            engine = FakeEngine(script)
            limits = {"max_turns": 6, "max_new_tokens": 30, "context_tokens": context, "max_total_tokens": total,
                      "summarize": summarize, "summary_max_tokens": 24, "max_observation_tokens": 8}  # fmt: skip
            ep = await loop(engine, **limits).run(task="task", tools={"calc": calc_tool([])})
            assert len(ep.token_ids) <= total, (context, total)
            assert all(len(r.prompt_ids) + r.max_new_tokens <= context for r in engine.requests), (context, total)
            assert ep.finish_reason in {"length", "max_turns"}
            assert_aligned(ep, engine)
            assert_tiled(ep)
            segments.add(ep.stats["segments"])
    assert segments == ({1, 2, 3, 4} if summarize else {1})  # up to max_segments

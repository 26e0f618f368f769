"""The agent loop on chat-template formats: token in, token out.

The engine returns scripted *id* sequences, some of which do not survive decode → encode; the episode must
be exactly the prompt ids, each turn's sampled ids, the masked closings and the rendered observations — so
nothing the model sampled is ever re-tokenised — with the loss mask on the sampled ids only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlbus.engines.base import GenerationRequest, GenerationResult, LogprobSpec
from rlbus.envs.agent import AgentLoop, run_episode
from rlbus.envs.base import Limits, Tool, make_env
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.envs.tool_calls import NATIVE_STOPS, format_native_call, tool_schema
from rlbus.schemas import Prompt


class IdEngine:
    """Returns scripted token ids verbatim (no stop token added), with distinct log-probs per call."""

    def __init__(self, turns: Iterable[Sequence[int]]) -> None:
        self.turns = deque(list(t) for t in turns)
        self.requests: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []

    @property
    def policy_version(self) -> int:
        return 3

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        pass

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return [self._one(r) for r in requests]

    def _one(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        ids = self.turns.popleft()[: request.max_new_tokens]
        call = len(self.requests)
        result = GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=tuple(ids),
            logprobs=torch.tensor([-(call + i / 1000) for i in range(len(ids))]),
            policy_versions=(3,) * len(ids),
            text="",
            finish_reason="stop",
            logprob_spec=LogprobSpec(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k),
        )
        self.results.append(result)
        return result


def lookup_tool() -> Tool:
    table = {"a": "b", "b": "hello", "hello": "42"}

    async def run(key: str) -> str:
        return table.get(key, "missing")

    return Tool("lookup", "follows a key to the next key", run)


def split_encode(tok: Any, *parts: str) -> list[int]:
    """Ids of ``parts`` tokenised one by one: a sequence the tokenizer itself would not produce."""
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False)]


#: "hello" in pieces that split a merge of both tokenizers (SmolLM2's, and the offline "he" / "ll").
HELLO = ("h", "el", "lo")


def script(tok: Any, chat: ChatFormat) -> list[list[int]]:
    """Six turns: two calls, a bad-JSON call, a call cut short at its stop string, a call, the answer."""
    eot = chat.turn_end

    def turn(prefix: tuple[str, ...], action: str, *, end: bool = True) -> list[int]:
        return [*split_encode(tok, *prefix), *tok.encode(action, add_special_tokens=False), *([eot] if end else [])]

    return [
        turn((*HELLO, ", I will look it up.\n"), format_native_call("lookup", {"input": "a"})),
        turn((*HELLO, " again\n"), format_native_call("lookup", {"input": "b"})),
        turn((*HELLO, " oops\n"), '<tool_call>\n{"name": "lookup", "arguments": {"input": "x"}\n</tool_call>'),
        turn((*HELLO, " retry\n"), format_native_call("lookup", {"input": "hello"}), end=False),
        turn((*HELLO, " one more\n"), format_native_call("nope", {"input": "1"})),
        turn((*HELLO, ": "), "<answer>42</answer>"),
    ]


async def play(tok: Any, *, system: str | None = "Follow the keys.") -> tuple[Episode, IdEngine, ChatFormat]:
    chat = ChatFormat.for_hf_tokenizer(tok)
    engine = IdEngine(script(tok, chat))
    loop = AgentLoop(engine=engine, chat=chat, limits=Limits(max_turns=8, max_new_tokens=200, context_tokens=4096))
    episode = await loop.run(task="Follow a to the end.", tools={"lookup": lookup_tool()}, system=system)
    return episode, engine, chat


def check_token_in_token_out(tok: Any, ep: Episode, engine: IdEngine, chat: ChatFormat) -> None:
    assert ep.finish_reason == "stop" and ep.answer == "42" and ep.stats["turns"] == 6
    observations = [t.text for t in ep.turns if t.role == "tool"]
    assert observations[:2] == ["b", "hello"] and observations[3] == "42"
    assert observations[2].startswith("error: tool call is not valid JSON")
    # how to call, shown with the episode's own tool (not a placeholder NAME a small model copies)
    assert observations[2].endswith('{"name": "lookup", "arguments": {"input": "INPUT"}}</tool_call> (tools: lookup)')
    assert observations[4].startswith("error: unknown tool 'nope'")

    eot, rest = chat.turn_end, list(chat.closing("assistant"))
    expected = list(engine.requests[0].prompt_ids)
    mask = [0] * len(expected)
    for k, result in enumerate(engine.results):
        assert list(engine.requests[k].prompt_ids) == expected  # each call saw exactly the ids so far
        sampled = list(result.token_ids)
        closing = rest if sampled[-1] == eot else [eot, *rest]  # a cut-short turn is closed, masked
        expected += sampled + closing
        mask += [1] * len(sampled) + [0] * len(closing)
        if k < len(observations):
            observation = chat.message_ids("tool", observations[k]) + list(chat.model_header)
            expected += observation
            mask += [0] * len(observation)
    assert ep.token_ids == expected
    assert ep.loss_mask == mask
    assert sum(ep.loss_mask) == sum(len(r.token_ids) for r in engine.results)

    # The sampled ids do not survive decode → encode, so re-tokenising would have changed them.
    for result in engine.results:
        sampled = [i for i in result.token_ids if i != eot]
        assert tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled

    # The prompt is the template's own rendering, and so is every observation.
    first = engine.requests[0]
    assert first.stop_token_ids == chat.stop_ids and set(NATIVE_STOPS) <= set(first.stop)
    system = ep.turns[0].text
    opening = [{"role": "system", "content": system}, {"role": "user", "content": "Follow a to the end."}]
    rendered = tok.apply_chat_template(opening, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert list(first.prompt_ids) == list(rendered)


async def test_smollm2_episode_is_token_in_token_out(smollm2_tokenizer: Any) -> None:
    ep, engine, chat = await play(smollm2_tokenizer)
    check_token_in_token_out(smollm2_tokenizer, ep, engine, chat)
    assert ep.turns[0].text.startswith("Follow the keys.\n\n") and '"name": "lookup"' in ep.turns[0].text


async def test_smollm2_without_a_system_message_gets_the_default_one(smollm2_tokenizer: Any) -> None:
    ep, engine, chat = await play(smollm2_tokenizer, system=None)
    check_token_in_token_out(smollm2_tokenizer, ep, engine, chat)
    assert ep.turns[0].role == "system" and ep.turns[0].text.startswith(chat.default_system or "?")


async def test_offline_chatml_episode_is_token_in_token_out(chatml_tokenizer: Any) -> None:
    ep, engine, chat = await play(chatml_tokenizer)
    check_token_in_token_out(chatml_tokenizer, ep, engine, chat)
    text = chatml_tokenizer.decode(ep.token_ids)
    assert text.startswith("<|im_start|>system\nFollow the keys.\n\n") and "<tool>" not in text
    assert "</tool_call><|im_end|>\n<|im_start|>tool\nhello<|im_end|>\n<|im_start|>assistant\n" in text


async def test_offline_template_with_tools_renders_them_itself(tools_tokenizer: Any) -> None:
    ep, engine, chat = await play(tools_tokenizer)
    check_token_in_token_out(tools_tokenizer, ep, engine, chat)
    text = tools_tokenizer.decode(ep.token_ids)
    schema = tool_schema("lookup", "follows a key to the next key")
    messages = [{"role": "system", "content": "Follow the keys."}, {"role": "user", "content": "x"}]
    rendered = tools_tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    assert text.startswith(rendered[: rendered.index("<|im_end|>")]) and "# Tools\n<tools>\n" in text
    assert "<|im_start|>user\n<tool_response>\nb\n</tool_response><|im_end|>\n" in text


async def test_run_episode_gives_native_instructions(chatml_tokenizer: Any) -> None:
    prompt = Prompt(
        prompt_id="p",
        env="kv",
        text="Find it from abc.",
        reference="42",
        env_config={
            "table": {"abc": "42"},
            "start": "abc",
            "context_tokens": 4096,
            "max_new_tokens": 200,
            "max_total_tokens": 8192,
        },
    )  # fmt: skip  (one token per byte: a long prompt)
    env = make_env(prompt.env, prompt.env_config)
    chat = ChatFormat.for_hf_tokenizer(chatml_tokenizer)
    turns = [format_native_call("get", {"input": "abc"}), "<answer>42</answer>"]
    engine = IdEngine([[*chatml_tokenizer.encode(t, add_special_tokens=False), chat.turn_end] for t in turns])
    ep = await run_episode(env, prompt, engine=engine, chat=chat)
    system = ep.turns[0].text
    assert "<tool name=" not in system and '"name": "get"' in system and "<answer>" in system
    assert [t.text for t in ep.turns if t.role == "tool"] == ["42"]
    assert (await env.score(ep, prompt)).value == 1.0


async def test_budgets_hold_with_closings(chatml_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(chatml_tokenizer)
    for context in range(640, 900, 37):  # the Hermes prompt alone is ~590 tokens of one byte each
        engine = IdEngine([chatml_tokenizer.encode(format_native_call("lookup", {"input": "a"}))] * 10)
        limits = Limits(max_turns=10, max_new_tokens=60, context_tokens=context, max_total_tokens=context)
        ep = await AgentLoop(engine=engine, chat=chat, limits=limits).run(task="t", tools={"lookup": lookup_tool()})
        assert len(ep.token_ids) <= context, context
        assert all(len(r.prompt_ids) + r.max_new_tokens + 1 + len(chat.closing("assistant")) <= context
                   for r in engine.requests)  # fmt: skip

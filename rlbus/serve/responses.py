"""Shaping the gateway's answers: choice bodies, the ``rl`` extension, headers, policy-version labels, and
JSON and error responses.

Every answer says which policy versions sampled it: ``system_fingerprint`` is
``rlbus:<model_id>:v<lo>[-v<hi>]`` over its tokens' versions, the ``X-RL-Policy-Version`` header the same
``<lo>[-<hi>]``, and the body's ``rl`` object lists them per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from aiohttp import web

from rlbus.engines.base import GenerationResult
from rlbus.envs.chat import ChatFormat
from rlbus.errors import ApiError
from rlbus.serve import api
from rlbus.serve.call import SESSION_HEADER, Call


def choice(
    call: Call, i: int, result: GenerationResult, chat: ChatFormat
) -> tuple[dict[str, Any], str | None, list[Any]]:
    """(choice body, content, tool_calls) of one result."""
    content, calls = api.split_tool_calls(reply_text(call, result, chat), enabled=call.tools)
    finish = "tool_calls" if calls else result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if call.request.logprobs:
        ids, lps = visible(result, chat)
        top = result.extra.get("top_logprobs")

        def piece(token: int) -> str:
            return chat.tokenizer.decode([token])

        logprobs = {"content": api.logprob_entries(ids, lps, None if top is None else top[: len(ids)],
                                                   piece), "refusal": None}
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}, content, calls


def reply_text(call: Call, result: GenerationResult, chat: ChatFormat) -> str:
    """The reply's text; a turn that ended at its first call (``parallel_tool_calls: false`` under ``auto``)
    gets back the ``</tool_call>`` its stop string cut, so the call parses."""
    text = result.text
    if (call.first_call_only and result.finish_reason == "stop" and result.token_ids
            and result.token_ids[-1] not in chat.stop_ids and chat.decode(result.token_ids).startswith(
                text + api.CALL_END)):
        return text + api.CALL_END
    return text


def visible(result: GenerationResult, chat: ChatFormat) -> tuple[list[int], list[float]]:
    """Sampled ids and log-probs without a final stop token (it is not part of the text)."""
    ids = list(result.token_ids)
    lps = [float(x) for x in result.logprobs.tolist()]
    if ids and ids[-1] in chat.stop_ids:
        ids, lps = ids[:-1], lps[:-1]
    return ids, lps


def rl_info(call: Call, results: list[GenerationResult]) -> dict[str, Any]:
    """The body's ``rl`` object: versions per choice, the session, history edits, recorded rollout ids."""
    return {
        "policy_versions": [sorted(set(r.policy_versions)) for r in results],
        "session_id": None if call.session is None else call.session.session_id,
        "history_edited": bool(call.edits), "history_edits": call.edits,
        "rollout_ids": call.rollout_ids() if call.record_rollout else [],
    }


def fingerprint(model_id: str, results: Sequence[GenerationResult]) -> str:
    return f"rlbus:{model_id}:v{versions(results, 'v')}"


def headers(call: Call, results: Sequence[GenerationResult] | None, policy_version: int) -> dict[str, str]:
    """The response headers; ``policy_version`` (the engine's) labels a response with no results yet."""
    version = versions(results, "") if results else str(policy_version)
    out = {"X-Request-Id": call.request_id, "X-RL-Served-Id": call.served_id, "X-RL-Policy-Version": version}
    if call.session is not None:
        out[SESSION_HEADER] = call.session.session_id
        out["X-RL-History"] = "edited" if call.edits else "ok"
        out["X-RL-History-Edits"] = str(call.session.edits)
    if call.record_rollout:
        out["X-RL-Rollout-Id"] = ",".join(call.rollout_ids())
        out["X-RL-Prompt-Id"] = call.prompt_id()
    return out


def versions(results: Sequence[GenerationResult] | None, prefix: str) -> str:
    """``lo`` or ``lo-<prefix>hi`` over the results' token versions; ``?`` when there are none."""
    found = sorted({v for r in results or () for v in r.policy_versions})
    if not found:
        return "?"
    lo, hi = found[0], found[-1]
    return f"{lo}" if lo == hi else f"{lo}-{prefix}{hi}"


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json",
                        headers=headers)


def error_response(exc: ApiError) -> web.Response:
    """OpenAI's error body (`rlbus.serve.api.error_body`), with ``Retry-After`` and ``WWW-Authenticate``."""
    out = {}
    if exc.retry_after_s is not None:
        out["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if exc.status == 401:
        out["WWW-Authenticate"] = 'Bearer realm="rlbus"'
    return json_response(exc.status, api.error_body(exc), out)

"""The OpenAI chat-completions wire format, at one boundary: request validation, error bodies, responses.

Everything the gateway accepts is decoded here into typed structs (msgspec) and checked against what
the engine can honour; everything it answers is built here. A request the gateway cannot serve exactly
as asked is refused — ``tool_choice: "required"`` without constrained decoding, a penalty the engine does
not apply, an image part — rather than served differently from what the client believes it asked for.
Every refusal is an :class:`rlbus.errors.ApiError`, rendered as OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` so the official client raises the matching exception
(``BadRequestError``, ``AuthenticationError``, ``NotFoundError``, ``RateLimitError`` …).

Tool calls. The model writes Hermes-style ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks
(`rlbus.envs.tool_calls`); a reply containing complete blocks is answered as OpenAI ``tool_calls`` (the
text before the first block is the ``content``, ``finish_reason`` ``"tool_calls"``). A block that does
not parse stays text: the client sees what the model wrote.

Log-probs are of the distribution each token was sampled from (after temperature and top-p), the
engine's ``processed`` log-probs — the same numbers the trainer's importance weights use. ``-inf``
(a token outside the nucleus, among ``top_logprobs`` under greedy decoding) is written as -9999.0, as
OpenAI does.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec

from rlbus.errors import ApiError

MAX_N = 8
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
NEG_INF_LOGPROB = -9999.0

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: dict[str, str]
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/chat/completions`` as accepted (the fields the engine honours)."""

    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    metadata: dict[str, str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


def bad(message: str, param: str | None = None, code: str | None = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, message, type="invalid_request_error", param=param, code=code)


def parse_request(body: bytes, *, max_n: int = MAX_N) -> ChatRequest:
    """Decode and check a request body; raises ApiError (400) naming the offending parameter."""
    try:
        request = msgspec.json.decode(body, type=ChatRequest)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if request.n > max_n:
        raise bad(f"n must be at most {max_n}, got {request.n}", "n")
    stops = stops_of(request)
    if len(stops) > MAX_STOP or any(s == "" for s in stops):
        raise bad(f"stop holds up to {MAX_STOP} non-empty strings", "stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise bad(f"{name} is not supported by this engine (only 0)", name, "unsupported_value")
    if request.top_logprobs and not request.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(request.tool_choice, NamedChoice) or request.tool_choice == "required":
        raise bad("tool_choice 'required' or a named function needs constrained decoding, which this engine "
                  "does not do; use 'auto' or 'none'", "tool_choice", "unsupported_value")
    for i, m in enumerate(request.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad(f"only text content parts are supported, not {part.type!r}",
                              f"messages[{i}].content[{j}].type", "unsupported_value")
        if m.role == "tool" and m.content is None:
            raise bad("a tool message needs content", f"messages[{i}].content")
    return request


def _validation_error(text: str) -> ApiError:
    """msgspec's ``Expected `int`, got `str` - at `$.n``` → a message and the parameter it names."""
    match = re.search(r"\s*- at `\$(\S*)`$", text)
    path = match.group(1).lstrip(".") if match else ""
    problem = text[: match.start()] if match else text
    field = re.search(r"(?:unknown|missing required) field `([^`]*)`", problem)
    if field:
        path = f"{path}.{field.group(1)}" if path else field.group(1)
    if problem.startswith("Object contains unknown field"):
        code = "unknown_parameter"
    elif problem.startswith("Object missing required field"):
        code = "missing_required_parameter"
    elif re.match(r"Expected `[^`]*`, got `", problem):
        code = "invalid_type"
    else:  # out of range, too short, not one of the allowed values
        code = "invalid_value"
    return bad(f"{path or 'body'}: {problem}", path or None, code)


def stops_of(request: ChatRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def text_of(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text or "" for part in message.content)


def internal_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """Request messages as `rlbus.envs.chat` messages (``developer`` is a system message)."""
    out: list[dict[str, Any]] = []
    for m in request.messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text_of(m)}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]
        out.append(message)
    return out


def tool_schemas(request: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template renders them; None when there are none or tool_choice is 'none'."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [msgspec.to_builtins(t) for t in request.tools]


# -- responses -----------------------------------------------------------------------------------------


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def split_tool_calls(text: str, *, enabled: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply: complete ``<tool_call>`` blocks become OpenAI tool calls."""
    if not enabled:
        return text, []
    calls: list[dict[str, Any]] = []
    first = None
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
        first = match.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return (content or None), calls


def turn_key(content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> str:
    """What identifies an assistant message the gateway returned, when the client sends it back: its
    content and its calls' names and (parsed) arguments — call ids and JSON spacing do not count."""
    calls = []
    for c in tool_calls or ():
        function = c.get("function", c)
        arguments = function.get("arguments", "")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            parsed = arguments
        calls.append([function.get("name"), parsed])
    return json.dumps([(content or "").strip(), calls], sort_keys=True, ensure_ascii=False)


def finite(x: float) -> float:
    return x if x > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def logprob_entries(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    piece: Callable[[int], str],
) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content``: one entry per sampled token (the stop token left out by the caller)."""
    out = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = piece(token)
        alternatives = [] if top is None else [
            {"token": piece(t), "logprob": finite(v), "bytes": list(piece(t).encode())} for t, v in top[i]
        ]
        out.append({"token": text, "logprob": finite(lp), "bytes": list(text.encode()), "top_logprobs": alternatives})
    return out

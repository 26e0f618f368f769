"""The OpenAI chat-completions wire format, at one boundary: request validation, error bodies, responses.

Everything the gateway accepts is decoded here into typed structs (msgspec) and checked against what
the engine can honour; everything it answers is built here. The rule: a field is **honoured** when the
engine does what it asks, **accepted** when it cannot change the sampled tokens (a no-op here, or an echo
of what an OpenAI response contained), and **refused** when it would change the sampled tokens and the
engine cannot do it — never served differently from what the client believes it asked for. Every refusal
is an :class:`rlbus.errors.ApiError`, rendered as OpenAI's body ``{"error": {"message", "type", "param",
"code"}}`` so the official client raises the matching exception (``BadRequestError`` …); an unknown field
is refused too (``unknown_parameter``), so a typo is not silently ignored.

Request fields (``POST /v1/chat/completions``; the Responses API maps onto these, `rlbus.serve.openai_responses`):

=========================================  ========  ==========================================================
``model``, ``messages``                    honoured  system / developer / user / assistant / tool messages
``tools`` (function), ``tool_choice``      honoured  ``none`` / ``auto`` by the chat template; ``required``
                                                     and a named function by constrained decoding
                                                     (`rlbus.engines.constraints`): the reply is one or more
                                                     ``<tool_call>`` blocks whose arguments follow the schema
``parallel_tool_calls``                    honoured  ``false``: exactly one call — by the grammar under
                                                     ``required`` / a named function; under ``auto`` the turn
                                                     ends at the first complete call (a stop string)
``response_format``                        honoured  ``text``: as without; ``json_object`` / ``json_schema``:
                                                     constrained decoding (``strict`` or not, the schema is
                                                     enforced); with tools under ``auto``: JSON or tool calls
``n``, ``temperature``, ``top_p``,         honoured  ``top_k`` is vLLM's extension; ``max_completion_tokens``
``top_k``, ``max_tokens``,                           wins over ``max_tokens``; ``temperature`` 0 is greedy: the
``max_completion_tokens``, ``stop``,                 point mass on the argmax, every log-prob exactly 0.0
``seed``, ``logprobs``, ``top_logprobs``,
``stream``, ``stream_options``
``user``, ``metadata``                     honoured  recorded; ``user`` marks a session with ``user_sessions``,
                                                     ``metadata.task`` names a session's task
``store``, ``reasoning_effort``,           accepted  no effect on the tokens: nothing is kept for retrieval
``service_tier``, ``prompt_cache_key``,              (every completion is recorded for RL regardless), the
``prompt_cache_retention``,                          model has no reasoning mode, the prefix cache is
``safety_identifier``, ``modalities``                automatic; ``modalities`` only ``["text"]``
(text), ``prediction``, ``verbosity``
(null), ``stream_options.include_obfuscation``
``presence_penalty``,                      refused   unless 0 / absent: the engine applies neither
``frequency_penalty``, ``logit_bias``
``functions``, ``function_call``           refused   the deprecated function API: use ``tools``
``audio``, image / audio / file parts      refused   text only
=========================================  ========  ==========================================================

What OpenAI responses contain and clients echo back in ``messages`` is accepted and ignored:
``annotations``, ``refusal`` (a string, or a ``refusal`` content part: its text is the content),
``audio: null``, ``function_call: null``, ``tool_calls[].index``, a content part's ``cache_control``,
and ``name``. A non-null ``audio`` or ``function_call`` on a message is refused (nothing here produced it).

Tool calls. The model writes Hermes-style ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks
(`rlbus.envs.tool_calls`); a reply containing complete blocks is answered as OpenAI ``tool_calls`` (the
text before the first block is the ``content``, ``finish_reason`` ``"tool_calls"``). A block that does
not parse stays text: the client sees what the model wrote.

Log-probs are of the distribution each token was sampled from (after a grammar's mask, temperature and
top-p), the engine's ``processed`` log-probs — the same numbers the trainer's importance weights use.
``-inf`` (a token outside the nucleus, among ``top_logprobs`` under greedy decoding) is written as -9999.0,
as OpenAI does.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec

from rlbus.engines.constraints import Constraint, json_constraint, json_or_calls, tool_call_constraint
from rlbus.errors import ApiError

MAX_N = 8
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
NEG_INF_LOGPROB = -9999.0

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
#: What closes a Hermes tool call: the stop string of ``parallel_tool_calls: false`` under ``auto``.
CALL_END = "</tool_call>"


class TextPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None
    """A ``refusal`` part's text (an assistant message echoed back)."""
    cache_control: dict[str, Any] | None = None
    """Anthropic-style prompt-caching marker (litellm passes it on): no effect, the prefix cache is automatic."""
    annotations: list[Any] | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"
    index: int | None = None
    """A streamed delta's position, kept when a client concatenates the deltas back into a message."""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(msgspec.Struct, kw_only=True):
    type: str = "content"
    content: Any = None


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


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


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
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
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
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # accepted, no effect on the tokens (module docstring)
    store: bool | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    prompt_cache_key: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    modalities: list[str] | None = None
    prediction: Prediction | None = None
    verbosity: None = None
    # refused unless absent (module docstring)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None


def bad(message: str, param: str | None = None, code: str | None = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, message, type="invalid_request_error", param=param, code=code)


def parse_request(body: bytes, *, max_n: int = MAX_N) -> ChatRequest:
    """Decode and check a request body; raises ApiError (400) naming the offending parameter."""
    try:
        request = msgspec.json.decode(body, type=ChatRequest)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return check_request(request, max_n=max_n)


def check_request(request: ChatRequest, *, max_n: int = MAX_N) -> ChatRequest:
    """What decoding cannot check: limits, what the engine cannot honour (module docstring), message rules."""
    if request.n > max_n:
        raise bad(f"n must be at most {max_n}, got {request.n}", "n")
    stops = stops_of(request)
    if len(stops) > MAX_STOP or any(s == "" for s in stops):
        raise bad(f"stop holds up to {MAX_STOP} non-empty strings", "stop")
    check_sampling(request)
    for i, m in enumerate(request.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if not ((part.type == "text" and part.text is not None)
                        or (part.type == "refusal" and part.refusal is not None)):
                    raise bad(f"only text content parts are supported, not {part.type!r}",
                              f"messages[{i}].content[{j}].type", "unsupported_value")
        if m.role == "tool" and m.content is None:
            raise bad("a tool message needs content", f"messages[{i}].content")
        for name in ("audio", "function_call"):
            if getattr(m, name) is not None:
                raise bad(f"messages[{i}].{name}: this gateway produces neither audio nor legacy function calls; "
                          "send tool_calls", f"messages[{i}].{name}", "unsupported_value")
    return request


def check_sampling(request: ChatRequest) -> None:
    """Refuse what would change the sampled tokens and is not done here (module docstring)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise bad(f"{name} is not supported by this engine (only 0)", name, "unsupported_value")
    if request.logit_bias:
        raise bad("logit_bias is not supported by this engine", "logit_bias", "unsupported_value")
    if request.functions is not None or request.function_call is not None:
        name = "functions" if request.functions is not None else "function_call"
        raise bad("the deprecated function-calling API is not supported: send tools and tool_choice", name,
                  "unsupported_value")
    if request.audio is not None or (request.modalities is not None and request.modalities != ["text"]):
        raise bad("this model answers in text only", "modalities" if request.audio is None else "audio",
                  "unsupported_value")
    if request.top_logprobs and not request.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    forced = isinstance(request.tool_choice, NamedChoice) or request.tool_choice == "required"
    if forced and not request.tools:
        raise bad("tool_choice requires a tool, and no tools were given", "tool_choice")
    if isinstance(request.tool_choice, NamedChoice):
        named = request.tool_choice.function.get("name")
        if named not in {t.function.name for t in request.tools or ()}:
            raise bad(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema is None):
        raise bad("response_format json_schema needs json_schema.schema", "response_format.json_schema")


def constraint_of(request: ChatRequest) -> Constraint | None:
    """The grammar the reply must follow: forced tool calls, JSON, JSON or calls (tools under ``auto`` with a
    JSON format), or None. Its schemas are not yet checked against a tokenizer (the gateway does that)."""
    tools = tool_schemas(request)
    parallel = request.parallel_tool_calls is not False
    if tools and (request.tool_choice == "required" or isinstance(request.tool_choice, NamedChoice)):
        name = request.tool_choice.function.get("name") if isinstance(request.tool_choice, NamedChoice) else None
        return tool_call_constraint(tools, name=name, parallel=parallel)
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema if fmt.type == "json_schema" and fmt.json_schema is not None else None
    if not tools:
        return json_constraint(schema)
    return json_or_calls(schema, tools, parallel=parallel)


def ends_at_first_call(request: ChatRequest) -> bool:
    """``parallel_tool_calls: false`` under ``auto``: the turn ends at the first complete call."""
    return bool(tool_schemas(request)) and request.parallel_tool_calls is False and constraint_of(request) is None


def validation_error(text: str) -> ApiError:
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
        return message.refusal or ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text or part.refusal or "" for part in message.content)


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


def new_id(prefix: str = "chatcmpl", sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


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

"""OpenAI's Responses API (``POST /v1/responses``) at one boundary: its items in, the gateway's own chat
request out, and the chat answer back as a Response object or its stream of events.

The gateway plays a Responses request exactly as a chat completion (`rlbus.serve.gateway`): the input items
become `rlbus.serve.api.ChatRequest` messages, so rendering, sessions (``X-RL-Session``), constrained
decoding and recording — token-exact on ``rl.served.v1``, sessions closed into rollouts — are the chat
path's, and the same field policy applies (`rlbus.serve.api`). What this module maps:

=====================================  ==============================================================
``instructions``                       a system message before everything else (not carried over by
                                       ``previous_response_id``, as at OpenAI)
``input`` (a string, or items)         ``message`` items (roles user / system / developer / assistant;
                                       ``input_text`` / ``output_text`` / ``refusal`` parts; images,
                                       files and audio refused), ``function_call`` items (an assistant
                                       turn's ``tool_calls``, merged with the message before them),
                                       ``function_call_output`` items (``tool`` messages),
                                       ``item_reference`` (an item of a stored response), ``reasoning``
                                       items (accepted and dropped: this model writes none)
``previous_response_id``               the stored conversation of that response (this tenant's, while
                                       stored) before ``input``; unknown: 400
                                       ``previous_response_not_found``
``store``                              honoured: true (the default) keeps the response in this gateway's
                                       memory for ``previous_response_id``, ``item_reference`` and
                                       ``GET``/``DELETE /v1/responses/{id}`` (bounded, an hour); false
                                       keeps nothing (recording for RL is separate and always happens)
``tools`` (``function``)               as chat tools; hosted tools (web search, files, computer, MCP …)
                                       refused
``tool_choice``, ``parallel_tool_calls``  as chat (``{"type": "function", "name"}`` is a named function)
``text.format``                        ``text`` / ``json_object`` / ``json_schema`` as ``response_format``
``max_output_tokens``, ``temperature``,   as chat; ``include`` may hold ``message.output_text.logprobs``
``top_p``, ``top_logprobs``, ``include``  (log-probs of the distribution sampled from)
``metadata``, ``user``, ``stream``     as chat
``reasoning``, ``truncation``,         accepted, no effect on the tokens (``truncation: auto`` never
``service_tier``, ``prompt_cache_key``,   truncates: an overflow is a 400, as with ``disabled``)
``prompt_cache_retention``,
``safety_identifier``, ``max_tool_calls``,
``stream_options``, ``text.verbosity``
``background``, ``conversation``,      refused: no background mode, no server-side conversations or
``prompt``                             prompt templates
=====================================  ==============================================================

Output: a ``message`` item (``output_text``, with ``logprobs`` when asked) when the reply has text, then
one ``function_call`` item per tool call; ``status`` ``incomplete`` (``max_output_tokens``) when the token
budget ran out. Streaming sends OpenAI's events in its order, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``, for text
``response.content_part.added``, ``response.output_text.delta`` … (as tokens are sampled),
``response.output_text.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``; finally
``response.completed`` (or ``response.incomplete``) carrying the whole response.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from rlbus.errors import ApiError
from rlbus.serve import api

#: ``include`` values accepted (none of the others changes anything this gateway returns but this one).
LOGPROBS = "message.output_text.logprobs"


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str = "text"
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses`` as accepted (module docstring)."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=api.MAX_TOP_LOGPROBS)] | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    seed: int | None = None
    stream: bool | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # accepted, no effect on the tokens
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None
    # refused unless absent
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def parse(body: bytes) -> ResponsesRequest:
    """Decode a request body; ApiError (400) naming the parameter."""
    try:
        request = msgspec.json.decode(body, type=ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise api.validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise api.bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if request.background:
        raise api.bad("background responses are not supported: poll nothing, stream instead", "background",
                      "unsupported_value")
    for name in ("conversation", "prompt"):
        if getattr(request, name) is not None:
            raise api.bad(f"{name}: server-side conversations and prompt templates are not kept here; send the "
                          "input (or previous_response_id)", name, "unsupported_value")
    return request


# -- input items → chat messages ---------------------------------------------------------------------------


def to_chat(request: ResponsesRequest, history: Sequence[api.ChatMessage],
            item: Callable[[str], dict[str, Any] | None]) -> api.ChatRequest:
    """The chat request a Responses request plays as: instructions, ``history`` (a previous response's
    conversation), the input items (``item`` resolves an ``item_reference``), and the fields mapped."""
    messages: list[api.ChatMessage] = []
    if request.instructions:
        messages.append(api.ChatMessage(role="system", content=request.instructions))
    messages += history
    messages += input_messages(request.input, item)
    if not messages:
        raise api.bad("input is empty", "input", "invalid_value")
    text_format = request.text.format if request.text is not None else None
    logprobs = LOGPROBS in (request.include or ()) or bool(request.top_logprobs)
    try:
        chat = api.ChatRequest(
            model=request.model, messages=messages, tools=function_tools(request.tools),
            tool_choice=_tool_choice(request.tool_choice), parallel_tool_calls=request.parallel_tool_calls,
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            max_completion_tokens=request.max_output_tokens, seed=request.seed, logprobs=logprobs or None,
            top_logprobs=request.top_logprobs if logprobs else None, stream=request.stream,
            user=request.user, metadata=request.metadata, response_format=_response_format(text_format),
        )
    except (TypeError, ValueError) as exc:
        raise api.bad(str(exc)) from None
    return api.check_request(chat)


def input_messages(value: str | list[dict[str, Any]], item: Callable[[str], dict[str, Any] | None]
                   ) -> list[api.ChatMessage]:
    """Input items as chat messages: an assistant's text and the calls after it become one assistant turn."""
    if isinstance(value, str):
        return [api.ChatMessage(role="user", content=value)] if value else []
    out: list[api.ChatMessage] = []
    for i, raw in enumerate(value):
        entry = raw
        if entry.get("type") == "item_reference":
            found = item(str(entry.get("id", "")))
            if found is None:
                raise api.bad(f"input[{i}]: no stored item {entry.get('id')!r}", f"input[{i}].id", "invalid_value")
            entry = found
        kind = entry.get("type", "message")
        if kind == "message":
            _add_message(out, entry, i)
        elif kind == "function_call":
            call = api.ToolCallIn(id=str(entry.get("call_id") or entry.get("id")), function=api.FunctionCall(
                name=_str(entry, "name", i), arguments=_str(entry, "arguments", i)))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_call_id is None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(api.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            out.append(api.ChatMessage(role="tool", tool_call_id=_str(entry, "call_id", i),
                                       content=_output_text(entry.get("output"), i)))
        elif kind == "reasoning":
            continue  # nothing this model wrote; another model's reasoning cannot be rendered
        else:
            raise api.bad(f"input[{i}]: items of type {kind!r} are not supported (messages, function calls and "
                          "their outputs are)", f"input[{i}].type", "unsupported_value")
    return out


def _add_message(out: list[api.ChatMessage], entry: dict[str, Any], i: int) -> None:
    role = entry.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise api.bad(f"input[{i}].role: {role!r} is not a message role", f"input[{i}].role", "invalid_value")
    content = entry.get("content", "")
    if not isinstance(content, str):
        if not isinstance(content, list):
            raise api.bad(f"input[{i}].content: a string or a list of parts", f"input[{i}].content", "invalid_type")
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                pieces.append(part["refusal"])
            else:
                raise api.bad(f"only text content parts are supported, not {kind!r}",
                              f"input[{i}].content[{j}].type", "unsupported_value")
        content = "".join(pieces)
    out.append(api.ChatMessage(role=role, content=content))


def _str(entry: dict[str, Any], name: str, i: int) -> str:
    value = entry.get(name)
    if not isinstance(value, str):
        raise api.bad(f"input[{i}].{name}: a string is required", f"input[{i}].{name}", "invalid_type")
    return value


def _output_text(value: Any, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise api.bad(f"input[{i}].output: a string or text parts", f"input[{i}].output", "invalid_type")


def function_tools(tools: list[dict[str, Any]] | None) -> list[api.ToolDef] | None:
    """Responses function tools (flat) as chat tools; any other tool type is refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise api.bad(f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}",
                          f"tools[{i}].type", "unsupported_value")
        fields = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        try:
            out.append(api.ToolDef(function=msgspec.convert(fields, api.FunctionDef)))
        except msgspec.ValidationError as exc:
            raise api.bad(f"tools[{i}]: {exc}", f"tools[{i}]", "invalid_value") from None
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise api.bad(f"tool_choice {choice!r} is not one of none, auto, required", "tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return api.NamedChoice(function={"name": choice["name"]})
    raise api.bad(f"tool_choice {choice.get('type')!r} is not supported (none, auto, required or a function)",
                  "tool_choice", "unsupported_value")


def _response_format(fmt: TextFormat | None) -> api.ResponseFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return api.ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise api.bad("text.format json_schema needs a schema", "text.format.schema")
        return api.ResponseFormat(type="json_schema", json_schema=api.JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description))
    raise api.bad(f"text.format {fmt.type!r} is not one of text, json_object, json_schema", "text.format.type")


# -- the chat answer → a Response -------------------------------------------------------------------------


def response_body(request: ResponsesRequest, chat_body: dict[str, Any] | None, *, response_id: str,
                  created: float) -> dict[str, Any]:
    """The Response object of a played request from the chat body the gateway built (choice 0); without a
    body, the response as a stream announces it (``in_progress``, no output)."""
    choice = chat_body["choices"][0] if chat_body is not None else None
    output = output_items(choice) if choice is not None else []
    finish = choice["finish_reason"] if choice is not None else None
    status = "in_progress" if choice is None else "incomplete" if finish == "length" else "completed"
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created,
        "completed_at": None if choice is None else time.time(), "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": request.model, "output": output, "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": request.store is not False, "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": {"format": {"type": "text"} if request.text is None or request.text.format is None
                 else msgspec.to_builtins(request.text.format)},
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
        "top_p": 1.0 if request.top_p is None else request.top_p, "top_logprobs": request.top_logprobs or 0,
        "truncation": request.truncation or "disabled", "user": request.user, "metadata": request.metadata or {},
        "usage": None,
    }
    if chat_body is not None:
        usage = chat_body["usage"]
        body["usage"] = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"],
                         "output_tokens_details": {"reasoning_tokens": 0}}
        body["system_fingerprint"], body["rl"] = chat_body["system_fingerprint"], chat_body["rl"]
    return body


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice as Responses output items: the message (when it has text), then its calls."""
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(api.new_id("msg", "_"), message["content"], logprobs, "completed"))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call, "completed"))
    return items


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": "" if status == "in_progress" else call["function"]["arguments"], "status": status}


def conversation(chat: api.ChatRequest, output: list[dict[str, Any]]) -> list[api.ChatMessage]:
    """What a stored response continues from: its messages (instructions left out) and its answer."""
    messages = [m for i, m in enumerate(chat.messages) if not (i == 0 and m.role == "system")]
    return messages + input_messages(output, lambda _: None)


@dataclass
class EventStream:
    """The streamed events of one response, numbered in order (module docstring)."""

    shell: dict[str, Any]
    """The response as announced: status ``in_progress``, no output yet."""
    sequence: int = 0
    message_id: str = field(default_factory=lambda: api.new_id("msg", "_"))
    opened: bool = False
    text: str = ""
    held: str = ""
    """Whitespace not yet sent: the message item opens with the first visible character (a reply that is
    only calls has none)."""

    def event(self, kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + msgspec.json.encode(data) + b"\n\n"

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.shell),
                self.event("response.in_progress", response=self.shell)]

    def delta(self, piece: str) -> list[bytes]:
        """Text as it is sampled; the message item opens with its first visible character."""
        if not self.opened and not piece.strip():
            self.held += piece
            return []
        out = [] if self.opened else self._open()
        piece, self.held = self.held + piece, ""
        self.text += piece
        return [*out, self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=piece, logprobs=[])]

    def finish(self, response: dict[str, Any]) -> list[bytes]:
        """The rest of the text, the items done, the calls, and the completed response."""
        out: list[bytes] = []
        items = response["output"]
        message = next((it for it in items if it["type"] == "message"), None)
        if message is not None:
            message["id"] = self.message_id  # the id the deltas named
            text = message["content"][0]["text"]
            if not self.opened:
                out += self._open()
            if len(text) > len(self.text) and text.startswith(self.text):
                out += self.delta(text[len(self.text):])
            part = message["content"][0]
            out += [self.event("response.output_text.done", item_id=self.message_id, output_index=0,
                               content_index=0, text=text, logprobs=part.get("logprobs") or []),
                    self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                               content_index=0, part=part),
                    self.event("response.output_item.done", output_index=0, item=message)]
        for index, item in enumerate(items):
            if item["type"] != "function_call":
                continue
            out += [self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                       "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=response)]

    def error(self, body: dict[str, Any]) -> bytes:
        error = body["error"]
        return self.event("error", code=error["code"], message=error["message"], param=error["param"])

    def _open(self) -> list[bytes]:
        self.opened = True
        return [self.event("response.output_item.added", output_index=0,
                           item=message_item(self.message_id, "", None, "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part=text_part("", None))]


# -- stored responses ---------------------------------------------------------------------------------------


@dataclass
class Stored:
    tenant: str
    body: dict[str, Any]
    conversation: list[api.ChatMessage]
    at: float


class ResponseStore:
    """The responses kept for ``previous_response_id``, ``item_reference`` and ``GET /v1/responses/{id}``:
    in this gateway's memory, per tenant, at most ``capacity`` (oldest dropped first), each for ``ttl_s``."""

    def __init__(self, *, capacity: int = 10_000, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._items: dict[str, tuple[str, dict[str, Any]]] = {}  # item id → (response id, item)

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, tenant: str, body: dict[str, Any], conversation: list[api.ChatMessage]) -> None:
        self._kept[body["id"]] = Stored(tenant, body, conversation, self._clock())
        for item in body["output"]:
            self._items[item["id"]] = (body["id"], item)
        while len(self._kept) > self.capacity:
            self._drop(next(iter(self._kept)))

    def get(self, response_id: str, tenant: str) -> Stored | None:
        self._expire()
        stored = self._kept.get(response_id)
        return stored if stored is not None and stored.tenant == tenant else None

    def previous(self, response_id: str, tenant: str) -> list[api.ChatMessage]:
        """The conversation ``previous_response_id`` continues; 400 when it is not (or no longer) stored."""
        stored = self.get(response_id, tenant)
        if stored is None:
            raise ApiError(400, f"previous response {response_id!r} is not stored here (store: false, expired, "
                                "or another gateway's)", param="previous_response_id",
                           code="previous_response_not_found")
        return list(stored.conversation)

    def item(self, item_id: str, tenant: str) -> dict[str, Any] | None:
        found = self._items.get(item_id)
        if found is None or self.get(found[0], tenant) is None:
            return None
        return found[1]

    def delete(self, response_id: str, tenant: str) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        stored = self._kept.pop(response_id)
        for item in stored.body["output"]:
            self._items.pop(item["id"], None)

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._kept and next(iter(self._kept.values())).at < horizon:
            self._drop(next(iter(self._kept)))

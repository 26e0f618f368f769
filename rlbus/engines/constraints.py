"""Constrained decoding: a grammar every sampled token must follow, applied as a per-row allowed-token mask.

A `Constraint` is a grammar in a serialisable form: a JSON schema (``response_format`` ``json_object`` /
``json_schema``) or a Lark grammar (``tool_choice`` ``"required"`` or a named function: Hermes
``<tool_call>`` blocks whose JSON follows the tools' parameter schemas, `tool_call_constraint`). It rides
on `rlbus.engines.base.GenerationRequest.constraint`. The grammar library is llguidance (the Rust core of
Microsoft's Guidance, and vLLM's ``guidance`` structured-outputs backend): one dependency-free wheel that
computes a token mask on the CPU in tens of microseconds, lazily, from an Earley parser over the
tokenizer's byte trie (Moskal et al., "llguidance", 2025).

The one hook between a constraint and an engine's sampling step (what an engine calls, nothing else):

    states  = [grammars.start(request.constraint) or None per row]         # at admission, one per row
    logits  = mask_logits(states, logits)     # [B, V] → [B, V]: −inf outside each constrained row's mask,
                                              #   before temperature / top-k / top-p; rows whose state is
                                              #   None are untouched, and a batch without any costs nothing
    ... processed log-probs, sample ...
    advance(states, tokens)                   # each state consumes the token its row sampled
    state.bits()                              # [N, W] int32: the masks the row's N tokens were sampled under

With the mask applied before temperature and truncation, the engine's distribution is

    π'(x) ∝ exp(z_x / τ) · 1[x ∈ allowed_t]   (then top-k / top-p as usual, `rlbus.engines.sampling`)

so the recorded log-probs are of the masked, renormalised distribution the token was drawn from. The masks
travel with the result (`GenerationResult.allowed`) and the rollout (`rlbus.schemas.AllowedTokens`), and
the trainer's re-forward masks the same logits (`rlbus.rl.logprobs.chunked_token_logprobs`), so the
importance ratio π_trainer / π_behaviour stays exact: 1 on-policy.

Masks are llguidance's layout: ``W = ceil(n_vocab / 32)`` int32 words per row, bit ``i % 32`` of word
``i // 32`` set when token ``i`` is allowed; ids at or beyond ``n_vocab`` (a model's padded vocabulary)
are never allowed. The end of a grammar allows only the end-of-turn tokens, so a constrained row stops by
sampling one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: llguidance's JSON options for every schema: the separators ``json.dumps`` writes (``", "`` and ``": "``,
#: as the chat template renders tool calls) rather than free whitespace, which a small model may otherwise
#: fill until its token budget runs out.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """A grammar a completion must follow: ``kind`` ``"json"`` (``source`` a JSON schema as text) or
    ``"lark"`` (``source`` a Lark grammar, llguidance's dialect: ``%json {schema}`` embeds a schema)."""

    kind: Literal["json", "lark"]
    source: str

    def grammar(self) -> str:
        """The llguidance grammar (serialised) of this constraint."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        return LLMatcher.grammar_from_lark(self.source)


def json_constraint(schema: Mapping[str, Any] | None = None) -> Constraint:
    """Any JSON object (``schema`` None: ``response_format`` ``json_object``), or one following ``schema``."""
    return Constraint("json", json.dumps(dict(schema) if schema is not None else {"type": "object"}))


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], *, name: str | None = None,
                         parallel: bool = True) -> Constraint:
    """One (``parallel`` False) or more Hermes tool calls and nothing else, each
    ``<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`` with the arguments following the named
    tool's parameter schema; ``name`` restricts them to that tool. ``tools`` are OpenAI function tools."""
    return Constraint("lark", f"start: calls\n{_calls_rules(tools, name, parallel)}")


def json_or_calls(schema: Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]], *,
                  parallel: bool = True) -> Constraint:
    """A JSON value following ``schema`` (None: any object) or tool calls as `tool_call_constraint` makes
    them: ``response_format`` json with tools the model may still call."""
    answer = {"x-guidance": JSON_OPTIONS, **(dict(schema) if schema is not None else {"type": "object"})}
    return Constraint("lark", f"start: answer | calls\nanswer: %json {json.dumps(answer)}\n"
                              f"{_calls_rules(tools, None, parallel)}")


def _calls_rules(tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool) -> str:
    """Lark rules ``calls`` / ``call`` / ``body`` for Hermes tool calls (`tool_call_constraint`)."""
    functions = [t.get("function", t) for t in tools]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise ValueError(f"no tool named {name!r}")
    calls = [{
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
    } for f in functions]
    schema = {"x-guidance": JSON_OPTIONS, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f'calls: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")


def words(n_vocab: int) -> int:
    """int32 words per mask row."""
    return (n_vocab + 31) // 32


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Masks [C, W] int32 → allowed [C, vocab] bool (ids beyond 32·W not allowed)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)  # [32]
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)  # [C, 32·W]
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(bits.shape[0], vocab - allowed.shape[1])], dim=1)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with rows ``rows`` [C] set to −inf outside their masks ``bits`` [C, W] (out of place)."""
    allowed = unpack(bits.to(logits.device), logits.shape[-1])  # [C, V]
    masked = logits[rows].masked_fill(~allowed, float("-inf"))  # [C, V]
    return logits.index_copy(0, rows, masked)  # [B, V]


class RowConstraint:
    """One row's grammar state: the mask of its next token, and every mask it sampled under."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._matcher = matcher
        self._words = words(n_vocab)
        self._masks: list[torch.Tensor] = []  # [W] int32 per sampled token
        self._next: torch.Tensor | None = None

    def next_mask(self) -> torch.Tensor:
        """[W] int32: the tokens the grammar allows next (computed once per step)."""
        if self._next is None:
            mask = torch.zeros(self._words, dtype=torch.int32)
            self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if self._matcher.is_error():
                raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")
            self._next = mask
        return self._next

    def advance(self, token: int) -> None:
        """Consume the sampled ``token`` (it was allowed: the mask made every other one impossible)."""
        self._masks.append(self.next_mask())
        self._next = None
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the grammar: {self._matcher.get_error()}")

    def bits(self) -> torch.Tensor:
        """[N, W] int32: the mask each sampled token was drawn under."""
        if not self._masks:
            return torch.zeros(0, self._words, dtype=torch.int32)
        return torch.stack(self._masks)


def mask_logits(states: Sequence[RowConstraint | None], logits: torch.Tensor) -> torch.Tensor:
    """The hook before sampling: logits [B, V] masked on the rows that carry a state (module docstring)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    bits = torch.stack([s.next_mask() for s in states if s is not None])  # [C, W]
    return apply_masks(logits, torch.tensor(rows, device=logits.device), bits)


def advance(states: Sequence[RowConstraint | None], tokens: Sequence[int]) -> None:
    """The hook after sampling: each constrained row consumes its sampled token."""
    for state, token in zip(states, tokens, strict=True):
        if state is not None:
            state.advance(token)


@dataclass
class Grammars:
    """Compiles constraints against one tokenizer (llguidance's token trie, built once, lazily: ~1 s for a
    49 k vocabulary). ``tokenizer`` is a `rlbus.envs.chat.ChatFormat` (its tokenizer a Hugging Face one or
    the byte tokenizer); a grammar's end allows only the format's stop ids."""

    chat: Any
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def n_vocab(self) -> int:
        return int(self.ll_tokenizer().vocab_size)

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _ll_tokenizer(self.chat)
            return self._tokenizer

    def check(self, constraint: Constraint) -> None:
        """Raise ValueError when ``constraint`` does not compile (a bad schema or grammar)."""
        from llguidance import LLMatcher

        try:
            grammar = constraint.grammar()
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        if error and not error.startswith("WARNING"):
            raise ValueError(error)

    def start(self, constraint: Constraint) -> RowConstraint:
        """A fresh grammar state for one row; ValueError when the constraint does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer(), constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint does not compile: {matcher.get_error()}")
        return RowConstraint(matcher, self.n_vocab)

    def replay(self, constraint: Constraint, tokens: Sequence[int]) -> torch.Tensor:
        """[N, W] the masks a row sampling ``tokens`` under ``constraint`` was drawn under (an engine that
        applies the grammar itself, vLLM, records its masks this way). RuntimeError when a token breaks it."""
        state = self.start(constraint)
        for token in tokens:
            state.advance(int(token))
        return state.bits()


class _ByteTokens:
    """The byte tokenizer as llguidance's tokenizer wrapper expects it: ids 0..255 are bytes, the special
    tokens above are marked special."""

    def __init__(self, tokenizer: Any) -> None:
        from rlbus.models.tokenizer import NUM_BYTES, SPECIAL_TOKENS

        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [bytes([i]) for i in range(NUM_BYTES)] + [b"\xff" + t.encode() for t in SPECIAL_TOKENS]
        self.special_token_ids = list(range(NUM_BYTES, NUM_BYTES + len(SPECIAL_TOKENS)))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def grammars_for(tokenizer: Any) -> Grammars | None:
    """The grammars of an engine whose tokenizer is a chat format (it names its tokenizer and stop ids: duck
    typed, so the engines need not import the environments' `rlbus.envs.chat`); None for a plain decoder."""
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer, "stop_ids"):
        return Grammars(tokenizer)
    return None


def _ll_tokenizer(chat: Any) -> Any:
    """llguidance's tokenizer for a chat format, ending grammars on its stop ids."""
    import llguidance

    tokenizer = chat.tokenizer
    stops = list(chat.stop_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=stops)
    from rlbus.models.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer)), eos_token=stops)
    raise ValueError(f"constrained decoding needs a Hugging Face or byte tokenizer, not {type(tokenizer).__name__}")

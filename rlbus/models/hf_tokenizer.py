"""A Hugging Face ``transformers`` tokenizer and its chat template behind rlbus's own tokenizer protocol.

This is the one module that calls a transformers tokenizer. `HFTokenizer` gives the harness plain ids and
strings: `encode` tokenises *message contents* (no BOS, and special-token strings in the text stay text, so
a tool printing ``<|im_end|>`` cannot close a turn), `encode_template` tokenises *template text* (role
headers, closings, tool blocks) with special tokens recognised, and `render` runs the chat template to a
string. `rlbus.envs.chat.ChatFormat.for_hf_tokenizer` derives the per-role ids from these; nothing else
needs transformers.

Tokenizers are loaded from local files only (``local_files_only=True``), like the models in
`rlbus.models.hf`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbus.errors import ConfigError


class HFTokenizer:
    """Wraps (never copies) a ``transformers`` tokenizer that has a chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenizer", "the tokenizer has no chat template")
        if tokenizer.eos_token_id is None:
            raise ConfigError("tokenizer", "the tokenizer has no eos token")
        self.hf = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None) -> HFTokenizer:
        """``AutoTokenizer`` from a local directory (or a GGUF file in it); never reaches a model hub."""
        from transformers import AutoTokenizer

        kwargs: dict[str, Any] = {"local_files_only": True}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        return cls(AutoTokenizer.from_pretrained(str(path), **kwargs))

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def bos_text(self) -> str | None:
        """The BOS token's string, which a template may write at the start (``{{ bos_token }}``)."""
        token = self.hf.bos_token
        return None if token is None else str(token)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """Ids of a message's content: no BOS/EOS added, special-token strings tokenised as plain text."""
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_template(self, text: str) -> list[int]:
        """Ids of text the chat template wrote: special tokens (``<|im_start|>`` …) become their ids."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids, special tokens written out (what the action parsers read)."""
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text for ``messages`` (and tool schemas, for templates that render them)."""
        text = self.hf.apply_chat_template(
            [dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(text)

    def template_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> list[int]:
        """``apply_chat_template(…, tokenize=True)``: the reference ids `ChatFormat` must reproduce."""
        ids = self.hf.apply_chat_template(
            [dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
        )
        return [int(i) for i in ids]

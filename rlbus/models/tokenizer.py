"""Byte-level tokenizer for the in-repo policy: 256 byte ids plus 16 special tokens.

Why bytes: there is no vocabulary file to ship or download, every string round-trips exactly (UTF-8 in,
UTF-8 out), and the vocabulary stays tiny (272), which keeps the demo and test models small. The price is
long sequences (one token per byte), acceptable for the CPU-sized tasks this model is for; real runs use
a Hugging Face model and its own tokenizer through `rlbus.models.hf`.

Id layout:

    ======  =================  ==========================================================
    id      token              use
    ======  =================  ==========================================================
    0-255   the byte value     UTF-8 bytes of the text
    256     ``<|pad|>``        padding (never attended to)
    257     ``<|bos|>``        start of a sequence
    258     ``<|eos|>``        end of the model's turn; engines stop on it
    259     ``<|system|>``     a system message follows
    260     ``<|user|>``       a user message follows
    261     ``<|assistant|>``  the model's turn follows
    262     ``<|tool_call|>``  the model calls a tool (arguments follow as text)
    263     ``<|tool_result|>`` environment output follows (loss-masked in training)
    264     ``<|summary|>``    a context summary follows (long episodes restart from it)
    265-271 ``<|reserved_N|>`` reserved, so new tags do not change the vocabulary size
    ======  =================  ==========================================================

`encode` never produces special tokens from text: a tool printing "<|eos|>" yields those bytes, not the
EOS token, so environment output cannot inject control tokens. Harnesses add tags explicitly by id.
"""

from __future__ import annotations

from collections.abc import Iterable

NUM_BYTES = 256
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool_call|>",
    "<|tool_result|>",
    "<|summary|>",
    *(f"<|reserved_{i}|>" for i in range(7)),
)
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 272

PAD_ID = NUM_BYTES + SPECIAL_TOKENS.index("<|pad|>")
BOS_ID = NUM_BYTES + SPECIAL_TOKENS.index("<|bos|>")
EOS_ID = NUM_BYTES + SPECIAL_TOKENS.index("<|eos|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, special tokens above (see the module docstring for the table)."""

    vocab_size: int = VOCAB_SIZE
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Text → ids: the UTF-8 bytes, optionally wrapped in BOS/EOS. Never emits other specials."""
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, BOS_ID)
        if eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Ids → text. Specials render as their tag (e.g. ``<|tool_call|>``) unless ``skip_special``.

        Byte runs are decoded with ``errors="replace"``: a model can emit invalid UTF-8 (or stop in the
        middle of a multi-byte character), and the text view must not fail on it; the ids stay exact.
        """
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < NUM_BYTES:
                run.append(i)
                continue
            if not NUM_BYTES <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {VOCAB_SIZE})")
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if not skip_special:
                parts.append(SPECIAL_TOKENS[i - NUM_BYTES])
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_id(self, token: str) -> int:
        """The id of a special token, e.g. ``token_id("<|user|>") == 260``."""
        try:
            return NUM_BYTES + SPECIAL_TOKENS.index(token)
        except ValueError:
            raise KeyError(f"{token!r} is not a special token") from None

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTES <= token_id < VOCAB_SIZE

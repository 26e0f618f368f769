"""GGUF files → model directories, converted once, with the special tokens the GGUF itself declares.

A GGUF file (`rlbus.models.sources`: ``[model] gguf = FILE`` or a shipped model) becomes a ``save_pretrained``
directory — float32 safetensors, config, tokenizer — that every role then loads with ``local_files_only``.
``transformers`` reads GGUF (with the ``gguf`` package) and dequantises its tensors; the model is rebuilt
from its config alone (a GGUF-loaded model carries a quantisation config and does not save as is).

What the conversion must not leave to luck:

* **Special tokens from the file's own metadata.** How ``transformers`` maps a GGUF's tokens to
  bos/eos/pad has changed between releases: under 5.17 SmolLM2's tokenizer came out with eos
  ``<|im_start|>`` and no pad, so the chat check refused it and ``models install``, ``generate`` and the demo
  failed, while the file says eos 2 (``<|im_end|>``), pad 2. `special_tokens` reads
  ``tokenizer.ggml.{bos,eos,padding,unknown}_token_id`` with the ``gguf`` package and the converter sets
  them on the tokenizer and in the model's config and generation config (`apply_special_tokens`).
* **Checked before it is cached.** The written directory's tokenizer is loaded back and, when it has a chat
  template, its chat format derived (`rlbus.envs.chat.ChatFormat.for_hf_tokenizer`: an assistant turn must
  end with a special token, the template's pieces must reproduce its ids) *before* the directory is renamed
  into the cache. A conversion that fails the check raises a ConfigError and leaves nothing behind.
* **A cache key of everything that changes the output.** ``$RLBUS_HOME/models/<stem>-<hash of the file's
  bytes>-c<CONVERTER_VERSION>-tf<transformers version>``: upgrading ``transformers`` or this converter
  converts again instead of reusing a directory an older, possibly wrong, conversion wrote.

The directory is written under a temporary name and renamed into place, so concurrent workers and crashes
never see half of it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from rlbus.config import rlbus_home
from rlbus.errors import ConfigError

Progress = Callable[[str], None]

#: Bump whenever the conversion writes something different for the same file: the cache key includes it.
CONVERTER_VERSION = 2
#: The tokenizer's special-token roles and the GGUF metadata keys that name their ids.
SPECIAL_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
}


def converted_gguf(file: Path, *, progress: Progress | None = None) -> Path:
    """The cached model directory of a GGUF file, converting it first if needed."""
    out = converted_dir(file)
    if (out / "config.json").is_file():
        return out
    say = progress or (lambda _msg: None)
    say(f"converting {file.name} → {out} (once; later starts load the safetensors)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(file, tmp, progress=say)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: its directory is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def converted_dir(file: Path) -> Path:
    """Where the conversion of a GGUF file lives (the cache key: see the module docstring)."""
    key = f"{file_hash(file)}-c{CONVERTER_VERSION}-tf{transformers_version()}"
    return rlbus_home() / "models" / f"{file.stem}-{key}"


def transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def convert_gguf(file: Path, out: Path, *, progress: Progress | None = None) -> None:
    """GGUF → ``save_pretrained`` directory (float32 safetensors + tokenizer) in ``out``, its special tokens
    those of the file's metadata, its chat format checked (ConfigError when it fails)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    say = progress or (lambda _msg: None)
    say("reading the tokenizer")
    specials = special_tokens(file)
    tokenizer = load_tokenizer(file)
    for role, (was, now) in apply_special_tokens(tokenizer, specials).items():
        say(f"{role} token {was!r} → {now!r} (the GGUF's own metadata)")
    say("dequantising the weights")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, quantization_config=GgufConfig(gguf_file=file.name, dequantize=True)
    )
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError("model.gguf", f"{file}: the converted weights do not fit the model (missing {missing}, "
                          f"unexpected {unexpected})")
    plain.tie_weights()
    for target in (plain.config, plain.generation_config):
        for role in ("bos", "eos", "pad"):
            if role in specials:
                setattr(target, f"{role}_token_id", specials[role])
    say("writing safetensors")
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    say("checking the chat format")
    check_directory(out, specials, source=file)


def load_tokenizer(file: Path) -> Any:
    """``transformers``' tokenizer of a GGUF file (its special tokens as this release maps them)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def special_tokens(file: Path) -> dict[str, int]:
    """The special-token ids the GGUF's metadata declares (`SPECIAL_KEYS`), by role; absent keys are left out."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ConfigError("model.gguf", "reading a GGUF file needs the 'gguf' package (rlbus[models])") from exc
    reader = GGUFReader(str(file))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    size = None if tokens is None else len(tokens.data)
    out = {}
    for role, key in SPECIAL_KEYS.items():
        field = reader.get_field(key)
        if field is None:
            continue
        out[role] = int(field.contents())
        if size is not None and not 0 <= out[role] < size:
            raise ConfigError("model.gguf", f"{file}: the GGUF's {role} token id {out[role]} is outside its "
                              f"vocabulary of {size}")
    return out


def apply_special_tokens(tokenizer: Any, specials: Mapping[str, int]) -> dict[str, tuple[str | None, str]]:
    """Make ``tokenizer``'s bos/eos/pad/unk the tokens of ``specials`` (ids by role), marked special; returns
    what changed, ``{role: (was, now)}``. The vocabulary is not changed: every id must already be a token."""
    size = len(tokenizer)
    wanted, changed = {}, {}
    for role, token_id in specials.items():
        if not 0 <= token_id < size:
            raise ConfigError("model.gguf", f"the GGUF's {role} token id {token_id} is outside its vocabulary "
                              f"of {size}")
        token = tokenizer.convert_ids_to_tokens(token_id)
        was = getattr(tokenizer, f"{role}_token", None)
        if was != token or getattr(tokenizer, f"{role}_token_id", None) != token_id:
            changed[role] = (None if was is None else str(was), str(token))
        wanted[f"{role}_token"] = token
    if wanted:
        tokenizer.add_special_tokens(wanted)
    if len(tokenizer) != size:
        raise ConfigError("model.gguf", "setting the GGUF's special tokens grew the vocabulary")
    for role, token_id in specials.items():
        if getattr(tokenizer, f"{role}_token_id") != token_id:
            raise ConfigError("model.gguf", f"the tokenizer's {role} token did not become id {token_id}")
    return changed


def check_directory(directory: Path, specials: Mapping[str, int], *, source: Path) -> None:
    """The written directory's tokenizer, loaded back as every role loads it: its special tokens are the
    metadata's and, with a chat template, its chat format derives. ConfigError otherwise."""
    from transformers import AutoTokenizer

    from rlbus.envs.chat import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    for role, token_id in specials.items():
        if getattr(tokenizer, f"{role}_token_id", None) != token_id:
            raise ConfigError("model.gguf", f"{source}: the converted tokenizer's {role} token is "
                              f"{getattr(tokenizer, f'{role}_token', None)!r}, the GGUF says id {token_id}")
    if getattr(tokenizer, "chat_template", None):
        try:
            ChatFormat.for_hf_tokenizer(tokenizer)
        except ConfigError as exc:
            raise ConfigError("model.gguf", f"{source}: the converted tokenizer fails the chat check, so nothing "
                              f"was cached: {exc}") from exc


def file_hash(file: Path) -> str:
    """xxh64 of the file's bytes (16 hex digits): a changed file converts again."""
    digest = xxhash.xxh64()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

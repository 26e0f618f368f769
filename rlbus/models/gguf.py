"""GGUF files → model directories: the conversion and its cache (moved from `rlbus.models.sources`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from rlbus.errors import ConfigError

Progress = Callable[[str], None]


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
    """Where the conversion of a GGUF file lives: ``$RLBUS_HOME/models/<stem>-<hash of its bytes>``."""
    from rlbus.models.sources import rlbus_home

    return rlbus_home() / "models" / f"{file.stem}-{file_hash(file)}"


def convert_gguf(file: Path, out: Path, *, progress: Progress | None = None) -> None:
    """GGUF → ``save_pretrained`` directory (float32 safetensors + tokenizer) in ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    say = progress or (lambda _msg: None)
    say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
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
    say("writing safetensors")
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def file_hash(file: Path) -> str:
    """xxh64 of the file's bytes (16 hex digits): a changed file converts again."""
    digest = xxhash.xxh64()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

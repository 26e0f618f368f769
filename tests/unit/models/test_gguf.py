"""GGUF conversion: special tokens from the file's metadata, the chat check before caching, the cache key.

The transformers-5.17 failure is reproduced by patching the converter's tokenizer loader to return what that
release produced for SmolLM2 (eos ``<|im_start|>``, no pad), so the test fails on a converter that trusts the
loader and passes on one that repairs the tokenizer from ``tokenizer.ggml.*_token_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlbus.errors import ConfigError
from rlbus.models import gguf as conversion
from tests.fixtures.gguf import tiny_gguf

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RLBUS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _as_517(monkeypatch: pytest.MonkeyPatch) -> None:
    """The converter's tokenizer loader, as transformers 5.17 mapped SmolLM2's GGUF: eos <|im_start|>, no pad."""
    real = conversion.load_tokenizer

    def broken(file: Path) -> Any:
        tokenizer = real(file)
        tokenizer.eos_token = "<|im_start|>"
        tokenizer.pad_token = None
        return tokenizer

    monkeypatch.setattr(conversion, "load_tokenizer", broken)


def test_the_517_tokenizer_is_repaired_from_the_gguf_metadata(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlbus.envs.chat import ChatFormat

    file = tiny_gguf(tmp_path / "smol.gguf")
    _as_517(monkeypatch)
    broken = conversion.load_tokenizer(file)
    with pytest.raises(ConfigError, match="does not end with a special token"):
        ChatFormat.for_hf_tokenizer(broken)  # what `models install`, `generate` and the demo failed on
    assert conversion.special_tokens(file) == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}

    out = conversion.converted_gguf(file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tokenizer.bos_token == "<|im_start|>"
    assert ChatFormat.for_hf_tokenizer(tokenizer).stop_ids == (2,)
    config = transformers.AutoConfig.from_pretrained(str(out), local_files_only=True)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (2, 2, 1)
    generation = transformers.GenerationConfig.from_pretrained(str(out), local_files_only=True)
    assert (generation.eos_token_id, generation.pad_token_id) == (2, 2)
    assert out.parent == home / "models" and conversion.converted_gguf(file) == out  # cached


def test_a_conversion_that_fails_the_chat_check_is_not_cached(tmp_path: Path, home: Path) -> None:
    # the metadata names a plain token ("he", id 259) as eos and <|endoftext|> as pad: <|im_end|>, which
    # closes every assistant turn of the template, is then not special
    file = tiny_gguf(tmp_path / "bad.gguf", eos=259, pad=0)
    with pytest.raises(ConfigError, match=r"chat check.*nothing was cached"):
        conversion.converted_gguf(file)
    assert not conversion.converted_dir(file).exists()
    assert list((home / "models").iterdir()) == []  # no temporary directory left either


def test_metadata_ids_outside_the_vocabulary_are_refused(tmp_path: Path, home: Path) -> None:
    file = tiny_gguf(tmp_path / "odd.gguf", eos=10_000)
    with pytest.raises(ConfigError, match="eos token id 10000 is outside"):
        conversion.converted_gguf(file)


def test_the_cache_key_names_the_converter_and_transformers(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 10)
    first = conversion.converted_dir(f)
    assert first.name.endswith(f"-c{conversion.CONVERTER_VERSION}-tf{transformers.__version__}")
    monkeypatch.setattr(conversion, "CONVERTER_VERSION", conversion.CONVERTER_VERSION + 1)
    second = conversion.converted_dir(f)
    monkeypatch.setattr(conversion, "transformers_version", lambda: "5.17.0")
    assert len({first, second, conversion.converted_dir(f)}) == 3

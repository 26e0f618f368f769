"""Model sources: one local directory from a path, a GGUF file or a shipped name, with named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbus.errors import ConfigError
from rlbus.models import sources
from rlbus.models.sources import ShippedModel, file_hash, model_dir, model_from_description, resolve_device


def test_exactly_one_source_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        model_dir()
    with pytest.raises(ConfigError, match="exactly one"):
        model_dir(name="smollm2-135m-instruct", path=tmp_path)


def test_a_path_must_be_a_model_directory(tmp_path: Path, tiny_hf_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        model_dir(path=tmp_path)
    assert info.value.field == "model.path" and "config.json" in str(info.value)
    assert model_dir(path=tiny_hf_dir) == tiny_hf_dir


def test_unknown_and_uninstalled_models_say_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shipped models: smollm2-135m-instruct"):
        model_dir(name="gpt-7")
    monkeypatch.setitem(sources.SHIPPED, "absent", ShippedModel(
        distribution="rlbus-no-such-distribution", file="x.gguf", pin="rlbus-no-such-distribution==1", description=""))
    with pytest.raises(ConfigError, match="rlbus models install absent"):
        model_dir(name="absent")
    with pytest.raises(ConfigError, match="no such file"):
        model_dir(gguf=tmp_path / "missing.gguf")


def test_the_cache_key_follows_the_files_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBUS_HOME", str(tmp_path / "home"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 10)
    first = sources.converted_dir(f)
    f.write_bytes(b"b" * 10)
    assert sources.converted_dir(f) != first and first.parent == tmp_path / "home" / "models"
    assert len(file_hash(f)) == 16


def test_descriptions_rebuild_the_architecture(tiny_hf_dir: Path) -> None:
    from rlbus.models.config import PolicyConfig
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.policy import Policy

    policy = model_from_description({"kind": "policy", "shape": PolicyConfig.tiny().__dict__})
    assert isinstance(policy, Policy) and policy.config == PolicyConfig.tiny()
    loaded = model_from_description({"kind": "hf", "path": str(tiny_hf_dir)})
    assert isinstance(loaded, HFCausalLM) and loaded.describe() == {"kind": "hf", "path": str(tiny_hf_dir)}
    rebuilt = model_from_description(HFCausalLM.from_config(loaded.hf.config).describe())
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in loaded.state_dict().items()}
    with pytest.raises(ValueError, match="cannot rebuild"):
        model_from_description({"kind": "onnx"})
    assert resolve_device("auto").type in ("cpu", "cuda") and resolve_device("cpu") == torch.device("cpu")


def test_smollm2_converts_once_and_loads_as_the_real_model(smollm2_dir: Path) -> None:
    from rlbus.models.base import weight_tensors
    from rlbus.models.sources import load_hf

    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "tokenizer.json").is_file()
    assert model_dir(name="smollm2-135m-instruct") == smollm2_dir  # cached: no second conversion
    model = load_hf(smollm2_dir, dtype=torch.bfloat16)
    assert model.num_params() == 134_515_008 and model.vocab_size == 49_152
    weights = weight_tensors(model)
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights  # tied: shipped once
    assert model.output_weight().data_ptr() == weights["model.embed_tokens.weight"].data_ptr()

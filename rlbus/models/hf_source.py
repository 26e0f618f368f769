"""The ``hf`` model kind: a Hugging Face causal LM from exactly one of ``name``, ``path`` or ``gguf``.

Every role loads it from one local *model directory* (`rlbus.models.sources.model_dir`: a ``save_pretrained``
directory as is, a GGUF file converted once into a cached one, or a model rlbus ships by name), with the model's
own tokenizer and chat template. With ``checkpoint`` the fields may name none: the checkpoint's model says where
its directory is. The directory is also what an engine that loads the model itself is given (vLLM). On the
command line a shipped model's name, a model directory or a ``.gguf`` file name an HF model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from rlbus.config import did_you_mean, parse
from rlbus.errors import ConfigError
from rlbus.models.kinds import ModelKind, ModelSource, Progress

if TYPE_CHECKING:
    import torch

    from rlbus.envs.chat import ChatFormat
    from rlbus.models.base import TrainableLM
    from rlbus.models.hf import HFCausalLM


class HFOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[model]`` of ``kind = "hf"``: exactly one of ``name``, ``path``, ``gguf`` (none with a checkpoint)."""

    #: A model rlbus ships (``smollm2-135m-instruct``, installed by ``rlbus models install NAME``).
    name: str | None = None
    #: A local ``save_pretrained`` directory (config.json, safetensors, tokenizer files).
    path: str | None = None
    #: A GGUF file, converted once into a cached safetensors directory under ``RLBUS_HOME``.
    gguf: str | None = None

    def given(self) -> list[str]:
        return [n for n in ("name", "path", "gguf") if getattr(self, n) is not None]


@dataclass(frozen=True)
class HFSource(ModelSource):
    """An HF model's ``directory`` on ``device``; ``name`` is the shipped model's, when it is one."""

    kind: ClassVar[str] = "hf"
    directory: Path
    device: str = "auto"
    name: str | None = None

    def build(self, dtype: torch.dtype | None = None, *, seed: int = 0) -> HFCausalLM:
        """The directory's weights (``seed`` draws nothing)."""
        import torch

        from rlbus.models.sources import load_hf

        return load_hf(self.directory, dtype=dtype or torch.float32, device=self.device)

    @property
    def label(self) -> str:
        return self.name or self.directory.name

    def load_tokenizer(self) -> Any:
        from rlbus.models.sources import load_tokenizer

        return load_tokenizer(self.directory)

    def chat_format(self) -> ChatFormat:
        from rlbus.envs.chat import ChatFormat

        return ChatFormat.for_hf_tokenizer(self.tokenizer)


class HFKind(ModelKind):
    """``kind = "hf"``: options are `HFOptions`."""

    def parse(self, table: Mapping[str, Any], *, checkpoint: bool) -> HFOptions:
        options: HFOptions = parse(HFOptions, dict(table), prefix="model")
        if len(options.given()) > 1 or not (options.given() or checkpoint):
            raise ConfigError("model.name", "kind = \"hf\" needs exactly one of name, path, gguf")
        return options

    def table(self, options: HFOptions) -> dict[str, Any]:
        return {name: getattr(options, name) for name in options.given()}

    def source(self, options: HFOptions, *, device: str, progress: Progress | None = None) -> HFSource | None:
        from rlbus.models.sources import model_dir

        if not options.given():
            return None
        directory = model_dir(name=options.name, path=options.path, gguf=options.gguf, progress=progress)
        return HFSource(directory, device=device, name=options.name)

    def check(self, options: HFOptions) -> str:
        from rlbus.models.sources import SHIPPED, model_dir, shipped_gguf

        if options.name is not None:
            if options.name not in SHIPPED:
                raise ConfigError("model.name", f"unknown model {options.name!r}"
                                  f"{did_you_mean(options.name, SHIPPED)} (shipped models: {', '.join(SHIPPED)})")
            return f"model: shipped model {options.name}, installed at {shipped_gguf(options.name)}"
        if options.path is not None:
            return f"model: model directory {model_dir(path=options.path)}"
        if options.gguf is not None:
            if not Path(options.gguf).expanduser().is_file():
                raise ConfigError("model.gguf", f"no such file: {options.gguf}")
            return f"model: GGUF file {options.gguf} (converted once on first use)"
        return "model: the checkpoint's Hugging Face model"

    def rebuild(self, description: Mapping[str, Any], *, dtype: torch.dtype, device: str) -> TrainableLM:
        """``{"path": DIR}`` → the directory's model; ``{"config": {...}}`` → a random model of that config
        (tests, benches)."""
        from rlbus.models.hf import HFCausalLM
        from rlbus.models.sources import load_hf, resolve_device

        if "path" in description:
            return load_hf(Path(description["path"]), dtype=dtype, device=device)
        if "config" not in description:
            raise ValueError(f"cannot rebuild a model from {dict(description)!r}: no path, no config")
        from transformers import AutoConfig

        data = dict(description["config"])
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        return HFCausalLM.from_config(config, dtype=dtype).to(resolve_device(device))

    def source_of(self, description: Mapping[str, Any], *, device: str) -> HFSource:
        if "path" not in description:
            raise ConfigError("model.checkpoint", "the checkpoint's model has no directory to load a tokenizer from")
        return HFSource(Path(description["path"]), device=device)

    def named(self, text: str, *, device: str, progress: Progress | None = None) -> HFSource | None:
        from rlbus.models.sources import SHIPPED, model_dir

        if text in SHIPPED:
            return HFSource(model_dir(name=text, progress=progress), device=device, name=text)
        if text.endswith(".gguf"):
            return HFSource(model_dir(gguf=text, progress=progress), device=device)
        path = Path(text).expanduser()
        if path.is_dir():
            return HFSource(model_dir(path=path), device=device)
        return None

    def names(self) -> list[str]:
        from rlbus.models.sources import SHIPPED

        return [*SHIPPED, "a model directory", "a .gguf file"]

    def checked_name(self, text: str) -> str | None:
        from rlbus.models.sources import SHIPPED, model_dir, shipped_gguf

        if text in SHIPPED:
            return f"{text} (shipped, installed at {shipped_gguf(text)})"
        if text.endswith(".gguf"):
            if not Path(text).expanduser().is_file():
                raise ConfigError("model", f"no such file: {text}")
            return f"{text} (a GGUF file)"
        if Path(text).expanduser().is_dir():
            return f"{model_dir(path=text)} (a model directory)"
        return None

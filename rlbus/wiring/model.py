"""The model of a run: which one every role builds, its chat format, and the trainer's starting weights.

A `ModelSource` is resolved once from ``[model]`` (`rlbus.launch.arguments.model_source`): the in-house
policy of a shape, or a Hugging Face model directory (a shipped name or a GGUF already converted, see
`rlbus.models.sources`). Trainer and rollout workers build from the same source — the trainer an fp32
master, each worker a bf16 copy — so their tensors have the same names and shapes and weight sync applies
deltas between them. The chat format comes with the model: the byte tokenizer's tags for the policy, the
model's own tokenizer and chat template for an HF model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from rlbus.envs.chat import ChatFormat
    from rlbus.models.config import PolicyConfig
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.policy import Policy

    Model = Policy | HFCausalLM


@dataclass(frozen=True)
class ModelSource:
    """The one model of a run (see the module docstring). ``directory`` is set for ``kind = "hf"``."""

    kind: Literal["policy", "hf"] = "policy"
    shape: PolicyConfig | None = None
    directory: Path | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if (self.kind == "policy") != (self.shape is not None) or (self.kind == "hf") != (self.directory is not None):
            raise ValueError("a policy source needs a shape, an hf source a directory")

    @classmethod
    def policy(cls, shape: PolicyConfig, *, device: str = "cpu") -> ModelSource:
        return cls(kind="policy", shape=shape, device=device)

    @classmethod
    def hf(cls, directory: Path, *, device: str = "cpu") -> ModelSource:
        return cls(kind="hf", directory=directory, device=device)

    @classmethod
    def of(cls, model: Any, *, device: str = "cpu") -> ModelSource:
        """The source a built model came from (what its `describe()` says: a checkpoint's model)."""
        from rlbus.errors import ConfigError
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
        import torch

        from rlbus.models.sources import load_hf, resolve_device

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
        from rlbus.models.sources import load_tokenizer

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


def parse_model(text: str, *, device: str = "cpu", progress: Callable[[str], None] | None = None) -> ModelSource:
    """A model named on the command line: ``tiny`` / ``bench`` / ``demo`` (in-house policy presets), a shipped
    HF model's name (``smollm2-135m-instruct``), a model directory, or a ``.gguf`` file."""
    from rlbus.models.config import DEMO_SHAPE, PolicyConfig
    from rlbus.models.sources import SHIPPED, model_dir

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
    from rlbus.errors import ConfigError

    names = ", ".join([*presets, *SHIPPED])
    raise ConfigError("model", f"{text!r} is none of: {names}, a model directory, a .gguf file")

"""Model kinds: what ``[model] kind`` names, and the `ModelSource` a run's roles build their model from.

A *kind* (`ModelKind`) is one module that owns everything about one way of getting a model:

* its ``[model]`` fields, parsed into its own options (`ModelKind.parse`) and written back (`ModelKind.table`);
* the source they name (`ModelKind.source`: a GGUF converted once, a directory checked), and what ``rlbus
  config check`` says about it without loading weights (`ModelKind.check`);
* rebuilding a model from its ``describe()`` — a checkpoint's model, a trainer rank's — (`ModelKind.rebuild`),
  and the source of such a model (`ModelKind.source_of`);
* the names it answers to on the command line (`ModelKind.named`: ``rlbus generate --model NAME``).

A `ModelSource` is the resolved model of a run: trainer and rollout workers build from the same source — the
trainer an fp32 master, each worker a bf16 copy — so their tensors have the same names and shapes and weight
sync applies deltas between them. It builds the model (``dtype``, its device, ``seed``), loads the tokenizer and
the chat format that come with the model, names it for logs, and says where its Hugging Face-format directory
is, for an engine that loads one itself (vLLM: `rlbus.engines.vllm_kind`).

Built in: ``policy`` (the in-house byte-level policy, `rlbus.models.policy_source`) and ``hf`` (a Hugging Face
causal LM, `rlbus.models.hf_source`), registered by import path. A user's kind is an ``rlbus.models`` entry
point or ``"package.module:Kind"`` (docs/extending.md). Importing this module — and a kind's module, which
`rlbus.launch.config` loads to parse ``[model]`` — never imports torch.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlbus.registry import Registry, subclass_check

if TYPE_CHECKING:
    import torch

    from rlbus.envs.chat import ChatFormat
    from rlbus.models.base import TrainableLM
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.policy import Policy

    Model = Policy | HFCausalLM

Progress = Callable[[str], None]


class ModelSource(abc.ABC):
    """The one model of a run (see the module docstring); each kind's is a frozen dataclass of its own."""

    #: The kind's registered name (``policy``, ``hf``): what logs and the model's ``describe()`` call it.
    kind: ClassVar[str]
    #: Whether torch's intra-op threads speed its CPU steps up (the in-house policy's matmuls are too small).
    threaded: ClassVar[bool] = True
    #: Where the model runs: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda:1`` …
    device: str
    #: A Hugging Face-format model directory (``config.json``, safetensors, tokenizer files) for an engine that
    #: loads the model itself; None when the model has none.
    directory: Path | None = None

    @classmethod
    def of(cls, model: Any, *, device: str = "auto") -> ModelSource:
        """The source a built model came from (what its `describe()` says, through its kind: a checkpoint's
        model)."""
        desc = model.describe()
        return model_kind(desc["kind"], field="model.checkpoint").source_of(desc, device=device)

    @abc.abstractmethod
    def build(self, dtype: torch.dtype | None = None, *, seed: int = 0) -> Model:
        """A fresh copy in ``dtype`` (float32 by default) on the source's device, initialised from ``seed``
        where the kind draws its weights."""

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """How logs (and, by default, the gateway) name the model."""

    @abc.abstractmethod
    def load_tokenizer(self) -> Any:
        """The model's tokenizer (`tokenizer` caches it)."""

    @abc.abstractmethod
    def chat_format(self) -> ChatFormat:
        """How messages become ids for this model (`chat` caches it; `rlbus.envs.chat`)."""

    @cached_property
    def tokenizer(self) -> Any:
        return self.load_tokenizer()

    @cached_property
    def chat(self) -> ChatFormat:
        return self.chat_format()

    @property
    def pad_id(self) -> int:
        """An id fed at padding slots (masked, so any valid id works; the tokenizer's pad when it has one)."""
        pad: Any = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "pad_id", 0)
        return int(pad)


class ModelKind(abc.ABC):
    """One kind of model (see the module docstring); stateless, made by `model_kind`."""

    @abc.abstractmethod
    def parse(self, table: Mapping[str, Any], *, checkpoint: bool) -> Any:
        """The kind's options from its ``[model]`` fields (every field but ``kind``, ``device`` and
        ``checkpoint``); ConfigError names ``model.<field>``. With ``checkpoint`` the checkpoint names the
        model, and the fields may name none."""

    @abc.abstractmethod
    def table(self, options: Any) -> dict[str, Any]:
        """The ``[model]`` fields of ``options`` (the inverse of `parse`)."""

    @abc.abstractmethod
    def source(self, options: Any, *, device: str, progress: Progress | None = None) -> ModelSource | None:
        """The source ``options`` name (converting what needs converting, once, reporting to ``progress``);
        None when they name none and the checkpoint's model is the run's."""

    @abc.abstractmethod
    def check(self, options: Any) -> str:
        """``rlbus config check``'s line on ``options``: the source resolves, without loading weights or
        converting anything (ConfigError naming the field when it does not)."""

    @abc.abstractmethod
    def rebuild(self, description: Mapping[str, Any], *, dtype: torch.dtype, device: str) -> TrainableLM:
        """The architecture a model's ``describe()`` gave (the weights its directory has, or fresh ones)."""

    @abc.abstractmethod
    def source_of(self, description: Mapping[str, Any], *, device: str) -> ModelSource:
        """The source a model with this ``describe()`` came from (a checkpoint's model); ConfigError naming
        ``model.checkpoint`` when it has none (no tokenizer to load)."""

    def named(self, text: str, *, device: str, progress: Progress | None = None) -> ModelSource | None:
        """The source ``text`` names on the command line (``rlbus generate --model``), None if not one of this
        kind's."""
        return None

    def names(self) -> list[str]:
        """The names `named` knows (for the error that lists them)."""
        return []

    def checked_name(self, text: str) -> str | None:
        """What `named` would make of ``text``, checked without loading or converting anything (``rlbus config
        check``'s words for it); None if ``text`` is not one of this kind's names."""
        return None

    def known_context(self, options: Any) -> tuple[ChatFormat, int] | None:
        """The chat format and context length (tokens) when both are known without loading the model (the
        byte-level policy), so ``rlbus config check`` can tell whether prompts fit; None otherwise."""
        return None


#: The model kinds by name (`rlbus.registry`): ``[model] kind``.
MODELS: Registry[type[ModelKind]] = Registry(
    "model kind", group="rlbus.models", field="model.kind", example="Kind",
    check=subclass_check(ModelKind, "a model kind (a subclass of rlbus.models.kinds.ModelKind)"),
)
MODELS.register("policy", "rlbus.models.policy_source:PolicyKind")
MODELS.register("hf", "rlbus.models.hf_source:HFKind")


def model_kind(name: str, *, field: str | None = None) -> ModelKind:
    """The kind ``name`` stands for (`MODELS`); ConfigError names ``field`` (``model.kind``)."""
    return MODELS.get(name, field=field)()

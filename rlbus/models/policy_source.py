"""The ``policy`` model kind: the in-house byte-level transformer (`rlbus.models.policy.Policy`) of a shape.

``[model]`` holds the shape's fields themselves (``d_model = 128``); each one not given keeps the demo's value
(`rlbus.models.config.DEMO_SHAPE`). With ``checkpoint`` the checkpoint's shape is the run's, and no shape field
may be given. The weights are drawn from ``seed``; the tokenizer is the byte tokenizer with its tagged chat
format, so the lengths of prompts are known without loading anything (`PolicyKind.known_context`). On the
command line the presets ``tiny``, ``bench`` and ``demo`` name a policy.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from rlbus.config import did_you_mean
from rlbus.errors import ConfigError
from rlbus.models.config import DEMO_SHAPE, PolicyConfig
from rlbus.models.kinds import ModelKind, ModelSource, Progress

if TYPE_CHECKING:
    import torch

    from rlbus.envs.chat import ChatFormat
    from rlbus.models.policy import Policy

#: ``rlbus generate --model NAME``'s policy presets.
PRESETS = {"tiny": PolicyConfig.tiny, "bench": PolicyConfig.bench, "demo": lambda: DEMO_SHAPE}
#: The ``[model]`` fields every kind has (`rlbus.launch.config.ModelSection`), suggested beside the shape's.
COMMON = ("kind", "checkpoint", "device")


@dataclass(frozen=True)
class PolicySource(ModelSource):
    """A policy of ``shape`` on ``device``."""

    kind: ClassVar[str] = "policy"
    threaded: ClassVar[bool] = False  # its matmuls are too small to gain from threads (and its bits would change)
    shape: PolicyConfig
    device: str = "auto"

    def build(self, dtype: torch.dtype | None = None, *, seed: int = 0) -> Policy:
        import torch

        from rlbus.models.policy import Policy
        from rlbus.models.sources import resolve_device

        torch.manual_seed(seed)
        return Policy(self.shape).to(dtype=dtype or torch.float32, device=resolve_device(self.device))

    @property
    def label(self) -> str:
        return "policy"

    def load_tokenizer(self) -> Any:
        from rlbus.models.tokenizer import ByteTokenizer

        return ByteTokenizer()

    def chat_format(self) -> ChatFormat:
        from rlbus.envs.chat import ChatFormat

        return ChatFormat.for_byte_tokenizer(self.tokenizer)


class PolicyKind(ModelKind):
    """``kind = "policy"``: options are the `PolicyConfig` (None with a checkpoint)."""

    def parse(self, table: Mapping[str, Any], *, checkpoint: bool) -> PolicyConfig | None:
        known = {f.name for f in dataclasses.fields(PolicyConfig)}
        for name in table:
            if checkpoint or name not in known:
                where = "with a checkpoint the model is the checkpoint's (no shape fields)" if checkpoint and \
                    name in known else f"the shape fields are {', '.join(sorted(known))}"
                raise ConfigError(f"model.{name}", f"unknown field{did_you_mean(name, [*known, *COMMON])} ({where})")
        if checkpoint:
            return None
        try:
            return msgspec.convert({**dataclasses.asdict(DEMO_SHAPE), **table}, PolicyConfig)
        except msgspec.ValidationError as exc:
            match = re.search(r"at `\$\.([^`]*)`", str(exc))
            raise ConfigError(f"model.{match.group(1) if match else ''}".rstrip("."), str(exc)) from None
        except ConfigError as exc:  # PolicyConfig's own checks name the field
            raise ConfigError(f"model.{exc.field}", exc.problem) from None

    def table(self, options: PolicyConfig | None) -> dict[str, Any]:
        return {} if options is None else dataclasses.asdict(options)

    def source(
        self, options: PolicyConfig | None, *, device: str, progress: Progress | None = None
    ) -> PolicySource | None:
        return None if options is None else PolicySource(options, device=device)

    def check(self, options: PolicyConfig | None) -> str:
        if options is None:
            return "model: the checkpoint's policy"
        return f"model: the in-house policy (d_model {options.d_model}, {options.n_layer} layers)"

    def rebuild(self, description: Mapping[str, Any], *, dtype: torch.dtype, device: str) -> Policy:
        from rlbus.models.policy import Policy
        from rlbus.models.sources import resolve_device

        return Policy(PolicyConfig(**description["shape"])).to(dtype=dtype, device=resolve_device(device))

    def source_of(self, description: Mapping[str, Any], *, device: str) -> PolicySource:
        return PolicySource(PolicyConfig(**description["shape"]), device=device)

    def named(self, text: str, *, device: str, progress: Progress | None = None) -> PolicySource | None:
        preset = PRESETS.get(text)
        return None if preset is None else PolicySource(preset(), device=device)

    def names(self) -> list[str]:
        return list(PRESETS)

    def checked_name(self, text: str) -> str | None:
        return f"{text} (an in-house policy preset)" if text in PRESETS else None

    def known_context(self, options: PolicyConfig | None) -> tuple[ChatFormat, int] | None:
        if options is None:
            return None
        from rlbus.envs.chat import ChatFormat

        return ChatFormat.for_byte_tokenizer(), options.max_seq

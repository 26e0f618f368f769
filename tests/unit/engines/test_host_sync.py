"""A decode step syncs with the host once: the copy of (token, log π') per row. Counted with a dispatch mode.

On a GPU every ``.item()``, ``nonzero``, boolean-mask index or device→host copy inside the step stalls the
launch queue until the device catches up, which is what made the engine host-bound (126 ms a step at batch
1 on an H200). CI has no GPU, so the count is taken on the CPU, where any op that *would* sync on a GPU
counts: scalar reads (``aten._local_scalar_dense``), ops whose output size depends on the data, boolean
indexing, cross-device copies, and ``tolist``/``numpy`` of a CPU tensor (invisible to the dispatcher, so
patched). The same test runs on CUDA where there is one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlbus.engines.base import GenerationRequest
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.policy import Policy, PolicyConfig

#: Ops whose result the host must wait for on a GPU (their output's size or value is read back).
DATA_DEPENDENT = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
                  "aten::_unique2", "aten::unique_consecutive", "aten::repeat_interleave",
                  "aten::nonzero_static"}  # fmt: skip


def _device(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class SyncCounter(TorchDispatchMode):
    """Counts the ops of the region that synchronise a GPU with the host (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.inside_copy = False  # in a counted tolist()/numpy(): its own device→host copy is that one sync

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if self.inside_copy:
            pass
        elif name in DATA_DEPENDENT:
            self.syncs.append(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_"):
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                self.syncs.append(f"{name} (boolean mask)")
        elif name == "aten::_to_copy" and "device" in kwargs and kwargs["device"] != _device(args[0]):
            if torch.device(kwargs["device"]).type == "cpu":
                self.syncs.append("device→host copy")
        elif name == "aten::copy_" and _device(args[0]) != _device(args[1]) and _device(args[0]) == torch.device("cpu"):
            self.syncs.append("device→host copy")
        return func(*args, **kwargs)


@contextmanager
def counting_syncs() -> Iterator[SyncCounter]:
    """A `SyncCounter` over the block, with ``tolist``/``numpy`` (a copy to the host, on any device) counted."""
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name: str) -> Any:
        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.syncs.append(f"{name}()")
            counter.inside_copy = True
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                counter.inside_copy = False
        return call

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with counter:
            yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _devices() -> list[Any]:
    """The CPU, and CUDA (marked ``cuda``) where there is one."""
    return ["cpu", *([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])]


def _per_step(engine: TorchEngine, method: str, requests: list[GenerationRequest]) -> list[list[str]]:
    """The syncs of each call of ``engine.<method>`` (one decode step) while ``requests`` generate."""
    steps: list[list[str]] = []
    decode = getattr(engine, method)

    def counted(*args: Any) -> Any:
        with counting_syncs() as counter:
            out = decode(*args)
        steps.append(counter.syncs)
        return out

    setattr(engine, method, counted)
    engine.generate(requests)
    return steps


def _requests(vocab: int, **kw: Any) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(prompt_ids=tuple(torch.randint(1, vocab, (3 + 4 * i,), generator=g).tolist()),
                              max_new_tokens=6 + i, seed=i, **kw) for i in range(4)]  # fmt: skip


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
                                      {"temperature": 0.0}])
def test_a_static_decode_step_copies_to_the_host_once(
    llama: Any, device: str, graphs: bool, sampling: dict[str, Any]
) -> None:
    """Eager, and in the capturable form (on CUDA: captured, then replayed)."""
    model = llama.to(device)
    try:
        engine = TorchEngine(model, max_batch=4, cuda_graphs=graphs)
        assert engine.static
        steps = _per_step(engine, "_decode_static", _requests(512, **sampling))
    finally:
        llama.to("cpu")
    assert len(steps) >= 8
    for syncs in steps:
        assert syncs == ["tolist()"], syncs


def test_a_dynamic_decode_step_of_a_dense_policy_copies_once() -> None:
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(vocab=272, d_model=64, n_layer=2, n_head=4, max_seq=128, n_experts=0, d_ff=64))
    engine = TorchEngine(policy.eval(), max_batch=4)
    assert not engine.static
    steps = _per_step(engine, "_decode", _requests(272, temperature=0.9, top_p=0.8))
    assert len(steps) >= 8 and all(syncs == ["tolist()"] for syncs in steps), steps


def test_the_counter_sees_what_would_sync() -> None:
    """The dispatch mode is not blind: each kind of sync in a step is counted."""
    for device in ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]:
        x = torch.randn(8, device=device)
        with counting_syncs() as counter:
            float(x.sum())
            x[x > 0]
            torch.nonzero(x)
            x.tolist()
            (x + 1).exp()  # no sync
        assert counter.syncs == ["aten::_local_scalar_dense", "aten::index (boolean mask)", "aten::nonzero",
                                 "tolist()"]  # fmt: skip
        if device == "cuda":
            with counting_syncs() as counter:
                x.cpu()
            assert counter.syncs == ["device→host copy"]

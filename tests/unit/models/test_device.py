"""Device resolution, the start-up line every role logs, and the GPU-sharing knob."""

from __future__ import annotations

import pytest
import torch

from rlbus.errors import ConfigError
from rlbus.models import device as dev


def test_auto_is_cuda_when_there_is_one_else_the_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.resolve_device("auto").type == expected and dev.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="not a device"):
        dev.resolve_device("gpu please")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_without_a_gpu_is_a_config_error_naming_what_torch_sees() -> None:
    with pytest.raises(ConfigError, match="torch sees no CUDA device") as info:
        dev.resolve_device("cuda")
    assert info.value.field == "model.device"


def test_a_role_announces_its_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "_announced", set())
    lines: list[str] = []
    info = dev.announce("auto", say=lines.append)
    dev.announce("auto", say=lines.append)
    assert len(lines) == 1 and lines[0].startswith("models on ") and info.memory_gib > 0
    if info.device == "cpu":
        assert "cores" in info.name and "GiB" in lines[0]
    else:
        assert info.free_gib is not None and info.capability is not None


def test_the_memory_fraction_is_checked_wherever_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dev.ENV_FRACTION, "1.5")
    with pytest.raises(ConfigError, match="not in"):
        dev.share(torch.device("cpu"))
    monkeypatch.setenv(dev.ENV_FRACTION, "half")
    with pytest.raises(ConfigError, match="not a number"):
        dev.share(torch.device("cpu"))
    monkeypatch.setenv(dev.ENV_FRACTION, "0.5")
    assert dev.share(torch.device("cpu")) is None  # a CPU has nothing to cap


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")
def test_the_memory_fraction_caps_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dev.ENV_FRACTION, "0.01")
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        assert dev.share(device) == 0.01
        total = torch.cuda.get_device_properties(device).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.02), dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def test_the_demo_takes_a_device() -> None:
    from rlbus.demo import demo_config

    assert demo_config().run.model.device == "cpu"  # the in-house policy: too small for a GPU
    assert demo_config(device="cuda").run.model.device == "cuda"
    assert demo_config(quick=True, device="auto").run.model.device == "auto"
    assert demo_config(model="smollm2-135m-instruct").run.model.device == "auto"

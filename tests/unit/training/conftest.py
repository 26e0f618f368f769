"""Training tests run torch on one thread: the results are then deterministic, and on a shared 2-core
machine two OpenMP threads only contend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""The device coder compiled for a real GPU (`rlbus.weights.codec.device`): a state on CUDA encodes to the CPU
coder's bytes and decodes there bit for bit. Needs a CUDA device (the GPU check runs it); on the CPU the same
code is checked through Triton's interpreter (`test_codec_device.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlbus.weights.codec import apply_chunk_, encode_state_delta
from tests.unit.weights.test_codec import evolve, make_state, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_state_on_cuda_codes_to_the_cpu_bytes_with_compiled_kernels() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":  # another test module put this process on the interpreter
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        test = f"{__file__}::test_a_state_on_cuda_codes_to_the_cpu_bytes_with_compiled_kernels"
        assert subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                              check=False).returncode == 0
        return
    old = make_state(5, [300_000, 9000, 700, 5, 2_500_000])
    new = evolve(old, 5, 0.04)
    cpu = encode_state_delta(old, new)
    gpu_old = {k: v.cuda() for k, v in old.items()}
    gpu_new = {k: v.cuda() for k, v in new.items()}
    chunks = encode_state_delta(gpu_old, gpu_new)
    assert [c.data for c in chunks] == [c.data for c in cpu]
    for c in chunks:
        apply_chunk_(gpu_old, c.data, expected_hash=c.hash)
    torch.cuda.synchronize()
    assert all(same_bits(gpu_old[k].cpu(), new[k]) for k in new)

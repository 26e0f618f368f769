"""The codec warm-up compiles every kernel specialisation a real sync needs, so no sync after it compiles
(`rlbus.weights.codec.warm`; the first run of the demo stalled on exactly that)."""

from __future__ import annotations

import torch
from numba.core.registry import CPUDispatcher

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.weights import _scatter
from rlbus.weights.codec import _kernels, apply_chunk_, encode_state_delta
from rlbus.weights.codec.warm import warm_kernels

#: Kernels only other kernels call (compiled into ``decode_sparse``): they never get a signature of their own.
INNER = {"class_masks", "decode_symbols", "select", "values"}


def signatures() -> dict[str, set[str]]:
    """Compiled signatures of every kernel called from Python (``_``-named helpers are inlined)."""
    return {f"{module.__name__}.{name}": {str(s) for s in f.signatures}
            for module in (_kernels, _scatter) for name, f in vars(module).items()
            if isinstance(f, CPUDispatcher) and not name.startswith("_") and name not in INNER}


def test_after_the_warm_up_a_real_delta_compiles_nothing() -> None:
    warm_kernels([torch.bfloat16, torch.int64])  # an integer buffer's dtype is skipped, not an error
    before = signatures()
    assert all(before.values())
    torch.manual_seed(0)
    old = {k: v.detach().to(torch.bfloat16) for k, v in Policy(PolicyConfig()).state_dict().items()
           if v.is_floating_point()}
    for lr in (1e-5, 1e-3):  # a sparse and a dense update of the demo's policy
        new = {k: (v.float() + lr * torch.randn(v.shape)).to(torch.bfloat16) for k, v in old.items()}
        held = {k: v.clone() for k, v in old.items()}
        for chunk in encode_state_delta(old, new):
            apply_chunk_(held, chunk.data, expected_hash=chunk.hash)
        assert all(torch.equal(held[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    assert signatures() == before
    assert warm_kernels([torch.bfloat16]) < 0.1  # once per process and dtype

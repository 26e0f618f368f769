"""One decode per chunk per process: workers that hold the same weights share their staged updates.

A chunk decodes against the weights it follows, so two workers on the same version — the same model
digest, the same device — stage it to the same positions and values. Several rollout workers in one
process (``rlbus demo`` runs them so, and so does ``rlbus bench sync``) each decoded every chunk of every
version, and on a CPU that multiplied the codec's cost by the number of workers. :class:`StagingCache`
decodes each (chunk, base digest, device) once; every other worker awaits the same result. Staged updates
are only read afterwards (the swap scatters them into each worker's own tensors), so sharing them is safe.

A worker served from the cache still downloads its chunk and checks its hash, so a damaged copy fails for
it as it would alone. Only the newest ``keep`` versions of a model stay cached, and a failed decode is
forgotten at once, so a worker that re-downloads a damaged chunk decodes it afresh.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping

import torch

from rlbus.weights.codec import StagedUpdate, chunk_hash, decode_chunk

Key = tuple[str, int, str, str, str]
Entry = asyncio.Future[list[StagedUpdate]]


class StagingCache:
    """Decoded chunks by (model, version, chunk hash, base digest, device), shared by a process's workers."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Key, Entry]] = (
            weakref.WeakKeyDictionary()
        )
        #: Decodes run, and decodes another worker's result served.
        self.decoded = 0
        self.shared = 0

    async def decode(
        self, state: Mapping[str, torch.Tensor], data: bytes, expected_hash: str, *, model_id: str, version: int,
        base_digest: str | None,
    ) -> list[StagedUpdate]:
        """The chunk decoded against ``state`` (whose digest is ``base_digest``; None: unknown, not shared)."""
        if base_digest is None:
            return await asyncio.to_thread(decode_chunk, state, data, expected_hash=expected_hash)
        device = str(next(iter(state.values())).device) if state else "cpu"
        key = (model_id, version, expected_hash, base_digest, device)
        loop = asyncio.get_running_loop()
        entries = self._loops.setdefault(loop, {})  # futures belong to one event loop
        found = entries.get(key)
        if found is not None:
            if chunk_hash(data) != expected_hash:  # this worker's copy is damaged: its own decode says so
                return await asyncio.to_thread(decode_chunk, state, data, expected_hash=expected_hash)
            self.shared += 1
            return await asyncio.shield(found)
        future: Entry = loop.create_future()
        entries[key] = future
        _forget_old(entries, model_id, self.keep)
        try:
            self.decoded += 1
            updates = await asyncio.to_thread(decode_chunk, state, data, expected_hash=expected_hash)
        except BaseException as exc:
            entries.pop(key, None)
            future.set_exception(exc)
            future.exception()  # retrieved here: a failure nobody else awaited is not an unhandled error
            raise
        future.set_result(updates)
        return updates


def _forget_old(entries: dict[Key, Entry], model_id: str, keep: int) -> None:
    versions = sorted({k[1] for k in entries if k[0] == model_id})
    for old in versions[:-keep]:
        for key in [k for k in entries if k[0] == model_id and k[1] == old]:
            del entries[key]


#: The process's cache: every `WeightSync` uses it unless given its own.
SHARED = StagingCache()

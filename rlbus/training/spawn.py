"""N trainer ranks on this machine without torchrun: spawned processes joined to a gloo group on CPU.

What the tests of the N-rank trainer and ``rlbus bench train --world-size N`` share: each rank is a fresh
interpreter (the ``spawn`` start method: a forked child would inherit the parent's threads and torch
state), joined to a gloo process group over a free local port, running the same module-level function
with its `Ranks`. A world of 1 runs the function in one spawned process *without* a process group
(``ranks`` None): the one-process trainer, measured under the same conditions as the ranks it is
compared with (a fresh interpreter, the same thread count). Results come back through files the
function writes: the processes share nothing else.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from rlbus.training.ranks import Ranks

RankFunction = Callable[..., None]
"""``fn(ranks: Ranks | None, *args)``, defined at module level (spawned processes import it by name)."""


def free_port() -> int:
    """A TCP port nobody listens on now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: RankFunction, rank: int, world: int, port: int, threads: int, args: tuple[Any, ...]) -> None:
    """One spawned rank: its threads, its place in the gloo group, ``fn``, and leaving the group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if world == 1:
        fn(None, *args)
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(Ranks(rank=rank, world=world), *args)
    finally:
        dist.destroy_process_group()


def _run_and_leave(target: Callable[..., None], *args: Any) -> None:
    """One spawned process: ``target(*args)``, then leave without the interpreter's teardown, where gloo's
    threads can still be winding down and abort the process ("terminate called without an active
    exception", exit -6: seen on a loaded two-core machine after a rank had finished, in `spawn_ranks`' ranks
    and in ranks that join their group themselves alike). A failure in ``target`` still exits non-zero.
    Python's own exit handlers still run (multiprocessing's release the semaphores it registered); only the
    C++ teardown after them is skipped."""
    target(*args)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: RankFunction, world: int, *args: Any, threads: int = 1, timeout_s: float = 300.0) -> None:
    """Run ``fn(ranks, *args)`` on ``world`` spawned ranks (torch ``threads`` each) and wait for them all.
    RuntimeError, after killing any left, when a rank fails or one is still running after ``timeout_s``:
    a collective that one rank never joins would otherwise hang the others for good."""
    spawn_processes(_entry_at, world, fn, world, threads, args, timeout_s=timeout_s)


def _entry_at(rank: int, port: int, fn: RankFunction, world: int, threads: int, args: tuple[Any, ...]) -> None:
    _entry(fn, rank, world, port, threads, args)


def spawn_processes(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 300.0) -> None:
    """Run ``target(rank, port, *args)`` in ``world`` spawned processes, ``port`` a free rendezvous port they
    share, and wait for them all (the same RuntimeError as `spawn_ranks`). For a rank that joins its group
    itself — through torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``), as
    `rlbus.launch.roles.trainer_main` does."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_run_and_leave, args=(target, r, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"ranks exited with {codes} (0 each expected)")

"""Builders: the one wiring of the RL loop (docs/architecture.md §9.1).

Config-free functions: plain keyword values in, unstarted objects out. `rlbus demo`, ``rlbus worker``
(`rlbus.launch.roles`), the chaos rig (`rlbus_tools.chaos.pipeline`) and the benchmarks assemble their parts
here; the parts that vary (model kinds, engines, environments, reward scorers) come from their registries
(`rlbus.registry`, docs/extending.md), so a new one is added in one place and every entry point gets it.
Only `rlbus.launch` reads the run config and turns it into these arguments (`rlbus.launch.arguments`:
one `TypedDict` per builder, so mypy checks each ``builder(**args)`` call).

* `infra`: the bus, the state store and the blob store (one factory each), claim checks;
* `rollout`: model → engine kind (its engine, batching front, weight sync) → rollout worker;
* `trainer`: trainer → weight publisher → join → trainer worker;
* `producer`: the prompt producer of a task, under admission control;
* `reward`: the reward worker and its scorers (the verifier, an LM judge, a user's).

The rollout stack's copy → torch engine → batching engine chain is `rlbus.engines.torch_stack`'s, which
the judge and the evaluation (below this layer) share.

Heavy imports (torch) happen inside the builders that need them, so the prompt producer and the reward
worker never load torch.
"""

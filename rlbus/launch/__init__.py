"""The distributed mode: one TOML run config, one process per role, and ``rlbus up`` for a local set.

``config`` is the run config (msgspec tables, env overrides for the connection settings); ``arguments`` is the
one reader of its fields, turning them into the arguments of the config-free builders in :mod:`rlbus.wiring`;
``roles`` holds one ``async`` main per role (``rlbus worker prompts|rollout|reward|trainer``), each taking
its bus, state store and blob store as arguments or building them from the config; ``signals`` the
graceful-stop helper every role uses; ``recording`` what the trainer and the workers write into the run
log; ``up`` the local process set; ``check`` what ``rlbus config check`` verifies before a run starts (it
reads fields only to check them and builds nothing). The bus wrapper that gives a run its own topics and
consumer groups is :mod:`rlbus.bus.namespace`; the trainer's in-order join, which makes a replay reproduce a
run's inputs, lives with the other joins in :mod:`rlbus.training.ordered`.
"""

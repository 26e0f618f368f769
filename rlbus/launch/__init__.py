"""The distributed mode: one TOML run config, one process per role, and ``rlbus up`` for a local set.

``config`` is the run config (msgspec tables, env overrides for the connection settings);
``build`` turns it into a bus, a state store and a blob store; ``roles`` holds one ``async`` main per
role (``rlbus worker prompts|rollout|reward|trainer``); ``signals`` the graceful-stop helper every role
uses; ``namespace`` the bus wrapper that gives a run its own topics and consumer groups; ``recording``
what the trainer and the workers write into the run log; ``up`` the local process set. The trainer's
in-order join, which makes a replay reproduce a run's inputs, lives with the other joins in
:mod:`rlbus.state.ordered`.
"""

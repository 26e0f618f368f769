"""Observing a running rlbus: what each process exports and how an operator reads the whole system.

``metrics`` (Prometheus metrics, the ``/metrics`` endpoint, consumer- and event-loop-lag probes),
``heartbeat`` (workers announcing themselves in the state store's registry), ``logs`` (one line per
event, human or JSON, naming topic/partition/offset, rollout id and version), ``status`` (the snapshot
behind ``rlbus status``) and ``runlog`` (a run directory's event files). Import the module you need:
this package imports nothing itself, so the bus can count messages without pulling in aiohttp or rich.
"""

"""Observing a running rlbus: how processes announce themselves and how an operator reads the whole system.

``heartbeat`` (workers announcing themselves in the state store's registry), ``lag`` (the consumer-lag
probe), ``logs`` (one line per event, human or JSON, naming topic/partition/offset, rollout id and version),
``status`` (the snapshot behind ``rlbus status``), ``collector`` and ``dashboard`` (``rlbus dashboard``),
``report`` and ``runlog`` (a run directory's event files). The metrics themselves, and the ``/metrics``
endpoint, are `rlbus.metrics`: a low module the bus counts messages through, below this package (which
reads the bus and the state store). Import the module you need: this package imports nothing itself.
"""

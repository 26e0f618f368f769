"""rlbus-tools: what the repository uses around the library, never imported by it.

Benchmarks (``bench``), fault-injection rigs (``chaos``), the fleet simulator (``sim``), local service launchers
(``services``: Kafka from its jars, Redis, Toxiproxy and the emulated WAN) and ``rlbus up`` (``up``). Their commands
join the ``rlbus`` command line through the ``rlbus.cli`` entry points (``cli``). A worker's installation
(``pip install rlbus``, the container image) does not carry this package; a checkout installs both
(``make venv``: ``pip install -e . -e tools``). docs/architecture.md §8 says where the line runs and why.
"""

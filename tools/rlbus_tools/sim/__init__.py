"""``rlbus sim``: a discrete-event model of an rlbus run at any scale (SimPy), checked against real runs.

On one machine the question "what will rlbus do on my fleet?" — staleness, WAN bytes, time until every
region serves a new version, GPU idle time, the async speedup — cannot be measured; it is predicted by
a model of the system as built, whose parameters come from measurements (:mod:`rlbus_tools.sim.calibrate`
reads them from a real ``rlbus up`` run's log, and ``rlbus bench sim-calibration`` checks the predictions
against the runs they came from).

What is modelled (:mod:`rlbus_tools.sim.model`): admission with the prompt producer's own
:class:`~rlbus.producers.prompts.Admission`, rollout fleets per region with a per-sequence decode rate
at a concurrency and heavy-tailed (log-normal) episode lengths, multi-turn tool time, reward scoring,
the ordered join, the trainer's step and sharded publishing, delta sizes from the codec's measured curve,
keyframes, relays and WAN links per region, staging and swap pauses, production traffic sharing the
fleet, KEDA-style autoscaling on the prompt group's lag, region cuts and preemptions.

What is not: token-level batching dynamics inside an engine (a worker's rate is an input), KV-cache
pressure, partial rollouts spanning versions (a group's version is the one it started on — the version
the trainer's staleness check uses), Kafka partition assignment (one shared queue), and bandwidth shared
by concurrent transfers other than an even split. The fleet file format is :mod:`rlbus_tools.sim.fleet`.
"""

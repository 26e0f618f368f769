"""Benchmarks behind ``rlbus bench NAME``; each measures its own baseline in the same run.

One module per benchmark: its measurement (``run(quick, json_path, …)``, which prints a short table and
returns the figures) and its command (``main``: its own options and its pass condition, exit status 1 when
that fails). :data:`BENCHMARKS` names them with a line each, which is all ``rlbus bench --help`` reads: a
benchmark's module (torch and all) is imported only when it runs.
"""

#: Every benchmark: its command name → what it measures (its module is the name with ``-`` as ``_``).
BENCHMARKS = {
    "bus": "Kafka against the in-memory bus: throughput and latency (or TLS + SCRAM's cost).",
    "codec": "The weight codec: delta sizes against peers, encode and decode+apply speed.",
    "sync": "Weight sync end to end: publish to every worker swapped, the swap pause.",
    "sandbox": "The sandbox: the escape suite and execution throughput.",
    "mismatch": "Training/inference mismatch with and without router replay.",
    "train": "The trainer: tokens/s per configuration, or N ranks against one.",
    "pipeline": "The demo's loop sync against async: time to a target accuracy.",
    "chaos": "Fault scenarios on real Kafka, Redis and workers, audited on the ledger.",
    "window": "Rollout workers' sliding window against batch-at-a-time generation.",
    "join": "The trainer's join: throughput and latency as groups grow.",
    "llm": "SmolLM2 through the whole loop: engine, trainer, codec on real deltas.",
    "swe": "The coding environment: corpus graded, attack suite, SmolLM2 episodes.",
    "online": "Learning from simulated users through the gateway.",
    "judge": "LM judges: agreement with the verifier, cost, prompt injection.",
    "engines": "The torch engine against vLLM on SmolLM2.",
    "decode": "The torch engine against transformers.generate: tokens/s, decode step, greedy agreement.",
    "serve": "The OpenAI-compatible gateway under load.",
    "firstsync": "A cold worker's first sync: kernel cache warm or empty.",
    "sim-calibration": "The simulator against real `rlbus up` runs.",
    "compose": "The whole loop in containers (images, scale, a broker killed).",
    "regions": "Regions over an emulated WAN with relays, a dead relay and a cut.",
}

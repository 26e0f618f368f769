"""``rlbus up``: a whole distributed run on one machine, every role its own process.

It brings up what the run needs and is missing — Kafka (a local KRaft broker, :mod:`rlbus_tools.services.kafka`,
when the bootstrap is local and nobody answers), Redis (a throwaway ``redis-server`` when the configured
one does not answer), the run's topics, and ``rlbus blobs serve`` on the run's blob directory — then
starts the trainer, a reward worker, N rollout workers in different regions and the prompt producer as
``rlbus worker …`` child processes, and prints their output line by line, prefixed with the worker's
name in its own colour. Without a namespace in the config, each ``rlbus up`` is a fresh run of its own
(``up-<date>-<time>``).

Children run in their own sessions, so a Ctrl-C in the terminal reaches only ``rlbus up``, which then
sends each child one SIGTERM (drain, commit, exit) and SIGKILLs whatever is still running after
``grace_s``; a second Ctrl-C kills them at once. ``--steps N`` stops the same way once the trainer's run
log shows step N. A child that exits on its own stops the rest. Kafka is left running (``rlbus kafka
stop``); Redis and the blob server started here are stopped.

The parts: ``services`` (each service a run needs, as a context that starts it when missing and stops what it
started), ``roles`` (the role processes' command lines), ``supervisor`` (starting children, relaying their
output, stopping them), ``secure`` (``--secure``: one credential per role) and ``run`` (the order they come up
in, and the wait).
"""

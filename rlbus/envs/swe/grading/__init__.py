"""The coding environment's grader: the reward side of ``env = "swe"`` (docs/architecture.md, "The grader's
trust boundary").

``grade`` (a patch → hidden-test verdict: filter, fresh copy, split tests, the launcher in the sandbox),
``split`` / ``split_params`` (the hidden tests rewritten so each assertion reports only its computed operands),
the launcher's own files ``grader_main`` / ``grader_runner`` / ``grader_guard`` / ``grader_values`` /
``grader_seccomp`` (copied into a directory of their own and run inside the sandbox, importing nothing of rlbus),
``monitor`` (static findings of reward hacking), ``check`` (``rlbus env check``), and the adversarial suites
that must all score 0: ``cheats`` and ``attacks``.
"""

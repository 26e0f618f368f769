"""The sandbox: untrusted programs (model-written code, hidden tests, agent tool calls) run inside bubblewrap
with rlimits, a wall-clock kill and a minimal environment (docs/architecture.md §6). The implementation is
:mod:`rlbus.sandbox.bwrap`; ``rlbus sandbox run FILE`` runs one file as the verifiers do."""

from rlbus.sandbox.bwrap import SANDBOX_DIR, Sandbox, SandboxLimits, SandboxResult, find_bwrap, find_python, run_file

__all__ = ["SANDBOX_DIR", "Sandbox", "SandboxLimits", "SandboxResult", "find_bwrap", "find_python", "run_file"]

"""Generate bug-fixing tasks for the `swe` environment from released Python libraries and their own tests.

The method is SWE-smith's (Yang et al., 2025, "SWE-smith: Scaling Data for Software Engineering Agents"):
start from a healthy repository whose test suite passes, inject a bug into a function the tests cover,
keep the tests that now fail as FAIL_TO_PASS and those that still pass as PASS_TO_PASS, and write the issue
from the failure. Unlike SWE-smith this package uses procedural AST mutations only (no language model, no
Docker): every step runs the library's tests in rlbus's bubblewrap sandbox, and the output is the
task-directory format `rlbus.envs.swe.task` loads, with shared base snapshots.

    module       concept
    ===========  ===========================================================================
    sdist        fetch a pinned sdist into the cache, extract it, find code and tests
    runtime      the pytest + hypothesis packages the sandboxed runs put on PYTHONPATH
    probe        the pytest plugin inside the sandbox: outcomes, errors, test → function calls
    runner       one sandboxed pytest run → a RunReport
    mutators     the bug kinds: sites in a function's AST, rewritten in its source text
    patches      bug.patch / solution.patch as unified diffs, applied with ``patch -p1``
    statement    the issue text from the failing tests' evidence
    taskdir      task directories, base archives, manifest.json
    generate     the loop: profile, mutate, run, keep or reject, validate, write
    ===========  ===========================================================================
"""

"""Re-check a written corpus from its files alone, the way a grader sees each task.

The generator validates a task from what it holds in memory before writing it; this reads back what was
written — extract ``_bases/…tar.gz``, apply ``environment/bug.patch``, restore the hidden ``tests/`` — runs
FAIL_TO_PASS + PASS_TO_PASS in the sandbox (all FAIL_TO_PASS must fail), applies
``solution/solution.patch`` and runs them again (all must pass). It catches a task whose files disagree
with its manifest entry, and it is the generator-side check until the `swe` environment's
``rlbus env check`` is available (that one is authoritative: it uses the environment's own loader and
grader). ``python -m rlbus.taskgen.verify CORPUS [--write]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlbus.errors import GenerateError
from rlbus.taskgen import patches, taskdir
from rlbus.taskgen.runner import TestRunner


@dataclass
class Verdict:
    id: str
    ok: bool
    reason: str
    unchanged_s: float = 0.0
    solution_s: float = 0.0


async def verify_task(runner: TestRunner, task: Path) -> Verdict:
    """One task's verdict; a patch that does not apply or an unreadable task.toml is a failed verdict."""
    try:
        return await _verify_task(runner, task)
    except (GenerateError, OSError, KeyError, tomllib.TOMLDecodeError, tarfile.TarError) as exc:
        return Verdict(task.name, False, f"{type(exc).__name__}: {exc}")


async def _verify_task(runner: TestRunner, task: Path) -> Verdict:
    config = tomllib.loads((task / "task.toml").read_text(encoding="utf-8"))
    tests = config["tests"]
    f2p, p2p = list(tests["fail_to_pass"]), list(tests.get("pass_to_pass", []))
    src = str(tests.get("env", {}).get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="rlbus-swegen-verify-") as tmp:
        repo = Path(tmp) / "repo"
        with tarfile.open(task / config["environment"]["base"]) as tar:
            tar.extractall(repo, filter="data")
        patches.apply(repo, (task / config["environment"]["patch"]).read_text(encoding="utf-8"))
        hidden = task / "tests"
        if hidden.is_dir():
            shutil.copytree(hidden, repo, dirs_exist_ok=True)
        unchanged = await runner.run(repo, f2p + p2p, src=src)
        patches.apply(repo, (task / "solution" / "solution.patch").read_text(encoding="utf-8"))
        solved = await runner.run(repo, f2p + p2p, src=src)
    verdict = Verdict(task.name, False, "", unchanged.wall_s, solved.wall_s)
    if not unchanged.usable or not solved.usable:
        verdict.reason = f"run not usable ({unchanged.status}/{solved.status})"
    elif passing := [n for n in f2p if n not in unchanged.tests or unchanged.tests[n].outcome == "passed"]:
        verdict.reason = f"unchanged repo passes FAIL_TO_PASS {passing[0]}"
    elif failing := [n for n in f2p + p2p if n not in solved.tests or solved.tests[n].outcome != "passed"]:
        verdict.reason = f"solution does not pass {failing[0]}"
    else:
        verdict.ok, verdict.reason = True, "ok"
    return verdict


async def verify(corpus: Path, *, write: bool = False) -> list[Verdict]:
    document = taskdir.read_manifest(corpus)
    verdicts = []
    with TestRunner() as runner:
        for index, entry in enumerate(document["tasks"], 1):
            verdict = await verify_task(runner, corpus / entry["path"])
            verdicts.append(verdict)
            print(f"[{index}/{len(document['tasks'])}] {verdict.id}: {verdict.reason} "
                  f"({verdict.unchanged_s:.1f}s / {verdict.solution_s:.1f}s)", flush=True)  # fmt: skip
            if write:
                entry["checked"] = {
                    "solution_reward": 1.0 if verdict.ok else 0.0,
                    "unchanged_reward": 0.0,
                    "solution_s": verdict.solution_s,
                    "unchanged_s": verdict.unchanged_s,
                    "by": "rlbus.taskgen.verify: task files only, bwrap sandbox, patch -p1",
                }
    if write:
        taskdir.write_manifest(corpus, document)
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlbus.taskgen.verify", description=__doc__)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--write", action="store_true", help="record the results in manifest.json")
    options = parser.parse_args(argv)
    verdicts = asyncio.run(verify(options.corpus, write=options.write))
    bad = [v for v in verdicts if not v.ok]
    print(f"{len(verdicts) - len(bad)}/{len(verdicts)} tasks check out")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

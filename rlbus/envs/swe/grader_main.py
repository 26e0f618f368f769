"""The grading launcher that runs inside the sandbox: it judges and signs, and never imports the code under test.

Started as ``python -I -B grader_main.py RUNTIME REPORT REPO EXTRA TRUSTED -- PYTEST_ARGS…`` with a one-time
key on stdin (RUNTIME: where the test runtime is mounted; the launcher and its runner are mounted elsewhere,
in grading sandboxes only; TRUSTED: the files the grader wrote into the repository). The trust boundary is
between two processes:

* **this launcher**, which reads the key, makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: a process of
  the same uid can no longer read its memory or descriptors through ``/proc``, nor ptrace it), and runs
  the tests in a child. It holds the key, decides the verdict record by record, and writes the signed
  report (HMAC-SHA256) outside the repository once the child has exited;
* **the runner** (`rlbus.envs.swe.grader_runner`), the child that imports the repository, runs pytest and
  reports over a pipe under an audit hook that code under test cannot remove. It holds no key, and its
  records carry a token that only the hook knows (see there).

The launcher believes the pipe only as far as it is consistent: the first line names the token; every
later line must carry it (a line that does not is code under test writing to the descriptor: tamper);
each test may report its ``call`` once; the stream must end with the runner's ``end`` record and that end's
exit code must be the process's. A child that exits early (``os._exit(0)`` at import) leaves no ``end``:
0. Cleaning the environment and building ``sys.path`` happen in the runner, before it imports pytest.
"""

import hashlib
import hmac
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PR_SET_DUMPABLE = 4


def _not_dumpable() -> None:
    """Keep processes of the same uid (the runner, anything it starts) out of this one's memory."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def read_records(stream, tampered: list) -> list:
    """The runner's records: the token from the first line, then every line that carries it."""
    first = stream.readline()
    token, _, hello = first.partition(b" ")
    if len(token) != 32 or not hello.startswith(b'{"hello"'):
        tampered.append("the test process did not start its report (no token line)")
        return []
    records = []
    for line in stream:
        mark, _, body = line.partition(b" ")
        if not hmac.compare_digest(mark, token):
            if len(tampered) < 20:
                tampered.append(f"a report line without the runner's token (forged): {line[:80]!r}")
            continue
        try:
            records.append(json.loads(body))
        except ValueError:
            tampered.append("an unreadable report line")
    return records


def judge(records: list, returncode: int, tampered: list) -> dict:
    """The report body from the records (the grader outside the sandbox reads phases and calls)."""
    phases: dict = {}
    calls: dict = {}
    collected: list = []
    end = None
    for record in records:
        if "tamper" in record:
            tampered.append(str(record["tamper"])[:500])
        elif "collected" in record:
            collected = [str(n) for n in record["collected"]]
        elif "phase" in record:
            phases.setdefault(str(record["phase"]), {})[str(record["when"])] = str(record["verdict"])
        elif "call" in record:
            calls[str(record["call"])] = record.get("ok") is True
        elif "end" in record:
            end = record["end"]
    if end is None:
        tampered.append(f"the test process ended without finishing its report (exit status {returncode})")
    elif end != returncode:
        tampered.append(f"the test process reported exit code {end} but exited with {returncode}")
    for nodeid, phase in phases.items():  # pytest's verdict for the call counts only if the test function ran
        if phase.get("call") == "passed" and not calls.get(nodeid, False):
            phase["call"] = "failed"
            if nodeid not in calls:
                tampered.append(f"pytest ran {nodeid} but its test function never ran under the grader")
    return {"exit_code": returncode, "phases": phases, "collected": collected, "tampered": tampered[:20]}


def main() -> int:
    key = sys.stdin.buffer.read(64)
    sys.stdin.close()
    _not_dumpable()
    runtime, report_path, repo, extra, trusted = sys.argv[1:6]
    args = sys.argv[sys.argv.index("--") + 1 :]
    read_fd, write_fd = os.pipe()
    runner = [sys.executable, "-I", "-B", os.path.join(_HERE, "grader_runner.py"), runtime, str(write_fd), repo,
              extra, trusted, "--", *args]  # fmt: skip
    child = subprocess.Popen(runner, stdin=subprocess.DEVNULL, pass_fds=(write_fd,), cwd=repo)
    os.close(write_fd)
    tampered: list = []
    with os.fdopen(read_fd, "rb") as stream:
        records = read_records(stream, tampered)
    returncode = child.wait()
    body = json.dumps(judge(records, returncode, tampered), sort_keys=True)
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    with open(report_path, "w") as f:
        json.dump({"body": body, "mac": mac}, f)
    return returncode


if __name__ == "__main__":
    sys.exit(main())

"""The grading launcher that runs inside the sandbox: it holds the answers, judges and signs, and never
imports the code under test.

Started as ``python -I -B grader_main.py RUNTIME REPORT REPO EXTRA -- PYTEST_ARGS…`` with, on stdin, a
one-time key (32 bytes) and then the plan of `rlbus.envs.swe.grading.split` as JSON: the hidden tests' visible code
(``files``) and, for every assertion, what the launcher alone knows (``slots``: the operation, where each
answer goes and its canonical form). The trust boundary is between two processes:

* **this launcher** reads its stdin, makes itself non-dumpable (no process of the same uid can read its
  memory or descriptors through ``/proc``, nor ptrace it), and runs the tests in a child. It holds the key
  and the answers, decides every assertion and every test, and writes the signed report (HMAC-SHA256)
  outside the repository once the child has exited;
* **the runner** (`rlbus.envs.swe.grading.grader_runner`), the child that imports the repository, gets the visible
  code on its stdin and reports over a Unix socket: the operands its assertions computed, the tests pytest
  ran. It holds no key and no answer.

The launcher believes the socket only as far as it is consistent. Each message carries its writer's pid
(``SO_PASSCRED``: the kernel fills it in), and only the runner may write: another writer (a forked child)
is tampering. The first line names the runner's token and every later line must carry it; ``collected``,
``end`` and each test's ``call`` come once (a phase may come again, for a subtest: one failure fails it);
nothing may follow ``end``, and ``end``'s exit code must be the process's. A runner that exits early
(``os._exit(0)`` at import) leaves no ``end``: 0.

Each assertion's record is compared here (`rlbus.envs.swe.grading.grader_values`): its computed operands decoded
from their canonical forms, the answers from the plan. A test passes when pytest's phases passed, its
function ran under the grader and returned, every assertion it made held, and every assertion at the top
of its body (the plan's *mandatory* slots) reported at all.
"""

import hashlib
import hmac
import json
import os
import select
import socket
import struct
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_CREDENTIALS = struct.calcsize("3i")


def _load(name: str) -> dict:
    namespace: dict = {"__name__": f"rlbus_{name}"}
    path = os.path.join(_HERE, f"{name}.py")
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace


def _not_dumpable() -> None:
    """Keep processes of the same uid (the runner, anything it starts) out of this one's memory."""
    _load("grader_seccomp")["not_dumpable"]()


def read_input(stream) -> tuple:
    """The key and the plan from stdin."""
    data = stream.read()
    key, plan = data[:32], json.loads(data[32:] or b"{}")
    if len(key) != 32 or type(plan) is not dict:
        raise SystemExit("rlbus grader: a key and a plan on stdin")
    return key, plan


def receive(sock, child) -> list:
    """``(writer pid, bytes)`` for everything sent on the socket until the runner has exited and nothing is
    left; descriptors passed along are closed (and reported by pid ``-1``)."""
    out: list = []
    sock.setblocking(False)
    space = socket.CMSG_SPACE(_CREDENTIALS) + socket.CMSG_SPACE(64 * 4)
    while True:
        exited = child.poll() is not None
        ready, _, _ = select.select([sock], [], [], 0.05 if not exited else 0)
        if not ready:
            if exited:
                return out
            continue
        try:
            data, ancillary, _flags, _addr = sock.recvmsg(1 << 16, space)
        except BlockingIOError:
            continue
        if not data:
            return out
        pid = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDENTIALS:
                pid = struct.unpack("3i", payload[:_CREDENTIALS])[0]
            elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                for fd in struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]):
                    os.close(fd)
                out.append((-1, b""))
        out.append((pid, data))


def read_records(chunks: list, runner: int, tampered: list) -> list:
    """The runner's records: only its pid may write; the token from the first line, then every line that
    carries it."""
    others = sorted({pid for pid, _ in chunks if pid != runner})
    for pid in others:
        what = "descriptors passed on the report channel" if pid == -1 else f"a second writer (pid {pid})"
        tampered.append(f"{what} on the report channel")
    lines = b"".join(data for pid, data in chunks if pid == runner).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        tampered.append("the report channel ended in the middle of a record")
        lines.pop()
    if not lines:
        tampered.append("the test process did not start its report (no token line)")
        return []
    token, _, hello = lines[0].partition(b" ")
    if len(token) != 32 or not hello.startswith(b'{"hello"'):
        tampered.append("the test process did not start its report (no token line)")
        return []
    records = []
    for line in lines[1:]:
        mark, _, body = line.partition(b" ")
        if not hmac.compare_digest(mark, token):
            if len(tampered) < 20:
                tampered.append(f"a report line without the runner's token (forged): {line[:80]!r}")
            continue
        try:
            records.append(json.loads(body.decode("utf-8", "surrogatepass")))
        except ValueError:
            tampered.append("an unreadable report line")
    return records


class Assertions:
    """The plan's slots, and the verdict on each assertion record."""

    def __init__(self, slots: dict, values: dict) -> None:
        self.slots = {int(k): v for k, v in slots.items()}
        self.values = values
        self.mandatory: dict = {}
        for n, slot in self.slots.items():
            if slot.get("mandatory"):
                self.mandatory.setdefault(slot.get("group"), set()).add(n)

    def where(self, n: object) -> str:
        slot = self.slots.get(n, {}) if type(n) is int else {}
        return f"{slot.get('path', '?')}:{slot.get('line', '?')}"

    def holds(self, record: dict) -> tuple:
        """(held, why not, tamper finding or None)."""
        n = record.get("check")
        slot = self.slots.get(n) if type(n) is int else None
        if slot is None or record.get("op") != slot["op"]:
            return False, "an assertion the hidden tests do not make", f"a forged assertion report ({n!r})"
        where = f"the assertion at {self.where(n)} ({slot['op']})"
        if "unverifiable" in record:
            why = f"{where} compares what the grader cannot read: {str(record['unverifiable'])[:200]}"
            return False, why, why
        if "result" in record:
            return record["result"] is True, f"{where} did not hold", None
        forms = record.get("values")
        layout = slot["layout"]
        if type(forms) is not list or len(forms) != layout.count("c"):
            return False, f"{where}: a malformed report", f"a malformed assertion report ({n})"
        answers = slot["answers"]
        if slot.get("cases"):  # a parametrised test's answers: those of the case the record ran in
            node = str(record.get("test") or "")
            case = slot["cases"].get(node[node.rfind("[") + 1 : -1] if node.endswith("]") else "")
            if case is None:
                return False, f"{where}: a case the hidden tests do not have", f"an unknown case ({node[:200]})"
            answers = {**answers, **case}
        operands, sent = [], iter(forms)
        try:
            for position, kind in enumerate(layout):
                form = next(sent) if kind == "c" else answers[str(position)]
                operands.append(self.values["decode"](form))
        except (ValueError, KeyError, IndexError, TypeError):
            return False, f"{where}: an operand that cannot be read", None
        op, tolerance = slot["op"], slot.get("tolerance") or {}
        if op == "approx":
            actual, expected = (operands[1], operands[0]) if layout.index("~") == 0 else (operands[0], operands[1])
            held = self.values["compare"](op, actual, expected, tolerance)
        else:
            held = self.values["compare"](op, *operands)
        return held, f"{where} did not hold", None


def judge(records: list, returncode: int, tampered: list, assertions: Assertions) -> dict:
    """The report body from the records (the grader outside the sandbox reads phases)."""
    phases: dict = {}
    calls: dict = {}
    keys: dict = {}
    collected: list = []
    seen_collected = False
    failures: dict = {}
    reached: dict = {}
    end = None
    ended = False
    for record in records:
        if type(record) is not dict:
            tampered.append("a report record that is not an object")
            continue
        if ended:
            tampered.append("a record after the test process's end record")
            break
        if "tamper" in record:
            tampered.append(str(record["tamper"])[:500])
        elif "collected" in record:
            if seen_collected:
                tampered.append("the tests were reported collected twice")
            seen_collected = True
            collected = [str(n) for n in record["collected"]]
        elif "phase" in record:
            phase_node, when = str(record["phase"]), str(record["when"])
            verdict, before = str(record["verdict"]), phases.get(phase_node, {}).get(when)
            if before is not None:  # subtests report their call each: one failure fails it
                verdict = _worst(before, verdict)
            phases.setdefault(phase_node, {})[when] = verdict
        elif "call" in record:
            call_node = str(record["call"])
            if call_node in calls:
                tampered.append(f"{call_node} reported its call twice")
            calls[call_node] = record.get("ok") is True
            keys[call_node] = record.get("fn")
        elif "check" in record:
            held, why, finding = assertions.holds(record)
            node = record.get("test")
            reached.setdefault(node, set()).add(record.get("check"))
            if finding is not None and len(tampered) < 20:
                tampered.append(finding)
            if not held:
                failures.setdefault(node if type(node) is str else None, []).append(why)
        elif "end" in record:
            end, ended = record["end"], True
    if not ended:
        tampered.append(f"the test process ended without finishing its report (exit status {returncode})")
    elif end != returncode:
        tampered.append(f"the test process reported exit code {end} but exited with {returncode}")
    everywhere = failures.get(None, [])
    for node, phase in phases.items():  # pytest's verdict counts only if the function ran and held
        if phase.get("call") != "passed":
            continue
        own = failures.get(node, [])
        key = keys.get(node)
        group = assertions.slots.get(key, {}).get("group") if type(key) is int else None
        missing = sorted(assertions.mandatory.get(group, set()) - reached.get(node, set())) if group else []
        if missing:
            own = [*own, f"returned without reaching the assertion at {assertions.where(missing[0])}"]
            tampered.append(f"{node} returned without reaching the assertion at {assertions.where(missing[0])}")
        if not calls.get(node, False) or own or everywhere:
            phase["call"] = "failed"
            failures[node] = (own or everywhere)[:5]
            if node not in calls:
                tampered.append(f"pytest ran {node} but its test function never ran under the grader")
    report_failures = {n: f[:5] for n, f in failures.items() if n is not None}
    return {"exit_code": returncode, "phases": phases, "collected": collected, "tampered": tampered[:20],
            "failures": report_failures}  # fmt: skip


def _worst(a: str, b: str) -> str:
    order = ("passed", "skipped", "failed")
    return max(a, b, key=lambda v: order.index(v) if v in order else len(order))


def main() -> int:
    key, plan = read_input(sys.stdin.buffer)
    sys.stdin.close()
    _not_dumpable()
    runtime, report_path, repo, extra = sys.argv[1:5]
    args = sys.argv[sys.argv.index("--") + 1 :]
    assertions = Assertions(plan.get("slots", {}), _load("grader_values"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    runner = [sys.executable, "-I", "-B", os.path.join(_HERE, "grader_runner.py"), runtime, str(theirs.fileno()),
              repo, extra, "--", *args]  # fmt: skip
    child = subprocess.Popen(runner, stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), cwd=repo)
    theirs.close()
    stdin = child.stdin
    try:
        if stdin is not None:
            stdin.write(json.dumps({"files": plan.get("files", {})}).encode())
            stdin.close()
    except BrokenPipeError:
        pass
    tampered: list = []
    chunks = receive(ours, child)
    returncode = child.wait()
    records = read_records(chunks, child.pid, tampered)
    body = json.dumps(judge(records, returncode, tampered, assertions), sort_keys=True)
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    with open(report_path, "w") as f:
        json.dump({"body": body, "mac": mac}, f)
    return returncode


if __name__ == "__main__":
    sys.exit(main())

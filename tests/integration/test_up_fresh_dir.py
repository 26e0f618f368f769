"""``rlbus up`` the way the README runs it on a fresh machine: from a new working directory with the default,
relative run directory (``runs/distributed/<namespace>``) and no Redis, so it starts its own ``redis-server``
there, against the suite's Kafka. It must reach its first trainer step and stop by itself with status 0.

Kafka is checked first: ``rlbus up`` would otherwise start a broker of its own, and this test must fail, not
pass or skip, when the suite's Kafka is missing.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from rlbus.launch.config import ENV_BLOB_URL, ENV_BOOTSTRAP, ENV_NAMESPACE, ENV_REDIS, ENV_RUN_DIR
from rlbus.launch.processes import rlbus_command
from rlbus.observe.runlog import STEPS, read
from rlbus_tools.services import free_port
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus
from tests.integration.test_distributed import Proc, eventually

UP_DEADLINE_S = 180.0
SMALL_RUN = """
[task]
group_size = 4
[model]
d_model = 64
n_layer = 2
d_ff = 64
[trainer]
groups_per_step = 1
warm_steps = 0
[rollout]
episode_threads = 8
"""


async def up_to_step_1(
    tmp_path: Path, prefix: str, extra_env: dict[str, str], flags: tuple[str, ...] = ()
) -> tuple[str, str]:
    """``rlbus up --config run.toml --steps 1`` in the working directory, against the suite's Kafka (checked
    first: ``rlbus up`` would otherwise start a broker of its own) with a Redis of its own; it must stop by
    itself with status 0. Returns the namespace and the output."""
    await (await kafka_bus()).close()
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in (ENV_RUN_DIR, ENV_NAMESPACE, ENV_BLOB_URL, "RLBUS_CONFIG")}
    env |= {ENV_BOOTSTRAP: KAFKA_BOOTSTRAP, ENV_REDIS: f"redis://127.0.0.1:{free_port()}/0", "PYTHONUNBUFFERED": "1",
            **extra_env}
    logs = tmp_path / "logs"
    logs.mkdir()
    argv = [*rlbus_command(), "up", "--config", "run.toml", "--rollout-workers", "1", "--steps", "1",
            "--namespace", namespace, "--grace", "20", *flags]
    up = Proc("up", argv, env, logs)
    try:
        async def exited() -> bool:
            return up.popen.poll() is not None

        await eventually(exited, "rlbus up to reach step 1 and stop", UP_DEADLINE_S, [up])
    finally:
        await up.stopped()
    out = up.text()
    assert up.popen.returncode == 0, out[-4000:]
    return namespace, out


@pytest.mark.slow
async def test_rlbus_up_from_a_fresh_directory_starts_redis_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(SMALL_RUN)
    namespace, out = await up_to_step_1(tmp_path, "it-up", {})
    run_dir = tmp_path / "runs" / "distributed" / namespace
    assert "started redis-server at redis://127.0.0.1:" in out, out[-4000:]
    assert (run_dir / "redis" / "redis.log").is_file()
    assert [s["step"] for s in read(run_dir, STEPS)][:1] == [1]
    assert "the trainer reached step 1; stopping" in out


USERS_RUN = """
[task]
prompts = "problems.jsonl"
group_size = 4
[reward]
function = "myreward:score"
[model]
max_seq = 256  # the prompts are ~95 byte tokens with the answer format's system message
d_model = 64
n_layer = 2
d_ff = 64
[trainer]
groups_per_step = 1
warm_steps = 0
[rollout]
episode_threads = 8
"""
USERS_PROBLEMS = [
    '{"env": "answer", "text": "Ann has 3 boxes of 12 eggs. How many eggs?", "reference": "36"}',
    '{"env": "answer", "text": "Tom had 20 marbles and lost 8. How many are left?", "reference": "12"}',
]
#: The user's reward function: it appends one line per call to the file RLBUS_TEST_CALLS names, so the test can
#: see that the reward worker ``rlbus up`` started (another process) imported it from PYTHONPATH and called it.
USERS_REWARD = """
import os

def score(prompt, completion, reference):
    with open(os.environ["RLBUS_TEST_CALLS"], "a") as calls:
        calls.write(f"{reference}\\n")
    return float(reference is not None and reference in completion)
"""


@pytest.mark.slow
async def test_rlbus_up_trains_a_users_prompt_file_with_their_reward_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newcomer's path under ``rlbus up``: their JSONL file (the ``answer`` environment) and their reward
    function in a module of their own, found by every process ``rlbus up`` starts through PYTHONPATH."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(USERS_RUN)
    (tmp_path / "problems.jsonl").write_text("\n".join(USERS_PROBLEMS) + "\n")
    package = tmp_path / "mycode"
    package.mkdir()
    (package / "myreward.py").write_text(USERS_REWARD)
    calls = tmp_path / "calls.txt"
    namespace, _ = await up_to_step_1(tmp_path, "it-up-user", {"PYTHONPATH": str(package),
                                                                "RLBUS_TEST_CALLS": str(calls)})
    assert [s["step"] for s in read(tmp_path / "runs" / "distributed" / namespace, STEPS)][:1] == [1]
    scored = calls.read_text().split()
    assert len(scored) >= 4 and set(scored) <= {"36", "12"}, scored  # a group of 4, from the user's file


@pytest.mark.slow
async def test_rlbus_up_secure_trains_with_one_credential_per_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlbus up --secure``: a secure local Kafka of its own (TLS, SCRAM, ACLs), one Kafka user, Redis user
    and blob key per role — and the run still reaches its first step with no request denied."""
    import stat

    from rlbus_tools.services import kafka

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(SMALL_RUN)
    home = tmp_path / "home"
    try:
        namespace, out = await up_to_step_1(tmp_path, "it-secure", {"RLBUS_HOME": str(home)}, ("--secure",))
    finally:
        kafka.stop(home / "secure-kafka", grace_s=10)
    assert "secure Kafka at 127.0.0.1:" in out and "Redis users for" in out, out[-4000:]
    assert "started redis-server at rediss://127.0.0.1:" in out  # TLS only, with the cluster's CA
    run_dir = tmp_path / "runs" / "distributed" / namespace
    assert [s["step"] for s in read(run_dir, STEPS)][:1] == [1]
    credentials = run_dir / "credentials"
    for role in ("trainer", "rollout", "reward", "producer", "gateway", "operator"):
        password = credentials / "kafka" / f"{role}.password"
        assert stat.S_IMODE(password.stat().st_mode) == 0o600
        assert password.read_text().strip() not in out
        assert f'sasl_username = "{namespace}.{role}"' in (credentials / "kafka" / f"{role}.bus.toml").read_text()
    for role in ("trainer", "rollout", "reward", "prompts", "serve"):
        assert (credentials / "redis" / role).read_text().strip() not in out
    security_log = (home / "secure-kafka" / "kafka" / "node-1" / "security.log").read_text()
    assert "Denied" not in security_log, security_log[-2000:]


@pytest.mark.slow
async def test_rlbus_up_regions_read_blobs_through_a_relay_per_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlbus up --regions``: one relay per region in front of the blob origin; each region's rollout worker
    syncs through its own relay, which fetched each chunk from the origin (and says so when it stops)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(SMALL_RUN)
    namespace, out = await up_to_step_1(tmp_path, "it-up-regions", {},
                                        ("--rollout-workers", "2", "--regions", "eu-west,us-east"))
    assert "2 regional relays of http://127.0.0.1:" in out, out[-4000:]
    run_dir = tmp_path / "runs" / "distributed" / namespace
    for region in ("eu-west", "us-east"):
        syncs = list(read(run_dir, f"syncs-rollout-{'0' if region == 'eu-west' else '1'}-{region}"))
        assert syncs, f"the {region} worker never synced"
        fetched = [line for line in out.splitlines() if f"relay-{region}" in line and "relay stopped: fetched" in line]
        assert fetched, out[-4000:]
        blobs = int(fetched[0].split("fetched ")[1].split()[0])
        assert blobs >= 1, fetched  # the worker's chunks came through its relay
        assert (run_dir / "relays" / region).is_dir() and any((run_dir / "relays" / region).rglob("*"))

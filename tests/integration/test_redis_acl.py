"""Redis ACL users per role (rlbus/security/redis_acl.py) on a real redis-server: each role's own code paths
work with its own user, and nothing else does — a rollout worker cannot touch the trainer's ledger, a run
cannot see another run's keys, only the operator administers, a wrong password gets nothing.

The users are created on the session Redis (``redis_url``, tests/fixtures/redis.py: fails, never skips, when
no Redis can be reached or started) under a unique namespace and deleted afterwards; its ``default`` user is
never touched. Turning ``default`` off, and sending the destructive commands for real, happens only on a
private ``redis-server`` each such test starts on a free port.
"""

from __future__ import annotations

import logging
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from typer.testing import CliRunner

from rlbus.bus import MemoryBus
from rlbus.errors import StateError
from rlbus.observe.heartbeat import Heartbeat
from rlbus.observe.status import take_snapshot
from rlbus.producers.prompts import progress_from_state
from rlbus.schemas import Prompt, Reward, Rollout, TensorData
from rlbus.security.redis_acl import (
    ROLES,
    apply_users,
    delete_users,
    generate_password,
    key_prefix_for,
    role_url,
    username,
)
from rlbus.state import RedisStateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, PROMPT_SEQ, VERSION_COUNTER, outcome_counter
from rlbus.training.join import FINAL, Outcome, RewardPolicy, ServedJoin
from rlbus.training.ordered import OrderedJoin, buffered_rollouts
from rlbus_tools.services.redis import RedisServer, start_redis

pytestmark = pytest.mark.redis

NON_OPERATORS = [r for r in ROLES if r != "operator"]
HEARTBEAT_ONLY = ["rollout", "reward", "serve"]


@dataclass
class Run:
    """One namespace's users on a Redis: URLs and stores per role."""

    admin_url: str
    namespace: str
    passwords: dict[str, str]

    @property
    def prefix(self) -> str:
        return key_prefix_for(self.namespace)

    def url(self, role: str, password: str | None = None) -> str:
        return role_url(self.admin_url, username(role, self.namespace), password or self.passwords[role])

    def store(self, role: str, *, key_prefix: str | None = None) -> RedisStateStore:
        return RedisStateStore.from_url(self.url(role), key_prefix=key_prefix or self.prefix)

    def client(self, role: str) -> Redis:
        return Redis.from_url(self.url(role))


async def _created(admin_url: str, namespace: str) -> Run:
    run = Run(admin_url, namespace, {role: generate_password() for role in ROLES})
    await apply_users(admin_url, run.passwords, namespace=namespace)
    return run


async def _clean(admin_url: str, namespace: str) -> None:
    await delete_users(admin_url, ROLES, namespace=namespace)
    admin = Redis.from_url(admin_url)
    try:
        keys = [key async for key in admin.scan_iter(match=key_prefix_for(namespace) + "*")]
        if keys:
            await admin.delete(*keys)
    finally:
        await admin.aclose()


@pytest.fixture
async def run(redis_url: str) -> AsyncIterator[Run]:
    """Users of every role for a fresh namespace on the session Redis; deleted, with the keys, afterwards."""
    namespace = f"acl-{uuid.uuid4().hex[:10]}"
    try:
        yield await _created(redis_url, namespace)
    finally:
        await _clean(redis_url, namespace)


@pytest.fixture
async def other_run(redis_url: str) -> AsyncIterator[Run]:
    namespace = f"acl-other-{uuid.uuid4().hex[:10]}"
    try:
        yield await _created(redis_url, namespace)
    finally:
        await _clean(redis_url, namespace)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, on a free port: its default user may be turned off."""
    with start_redis(dir=tmp_path / "redis") as server:
        yield server


# --- the roles' own code paths ------------------------------------------------------------------------------
def rollout(seq: int, i: int, size: int = 2, *, served: bool = False) -> Rollout:
    prompt_id = f"p{seq:04d}"
    t = TensorData.from_numpy(np.zeros(2, dtype=np.int32))
    metadata = {"origin": "served", "tenant": "acme", "session_id": f"s{seq}"} if served else {}
    return Rollout(
        rollout_id=f"{prompt_id}/{i}", prompt_id=prompt_id, group_index=i, group_size=size, token_ids=t,
        loss_mask=TensorData.from_numpy(np.ones(2, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(2, dtype=np.float32)), token_versions=t, created_at=1000.0,
        prompt=Prompt(prompt_id=prompt_id, env="arith", text="1+1=", group_size=size, metadata={"seq": str(seq)}),
        metadata=metadata,
    )


def reward(seq: int, i: int, source: str = "verifier") -> Reward:
    prompt_id = f"p{seq:04d}"
    return Reward(reward_id=f"{prompt_id}/{i}:{source}", rollout_id=f"{prompt_id}/{i}", prompt_id=prompt_id,
                  source=source, value=float(i))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def trainer_session(run: Run) -> list[str]:
    """What the trainer does with the state store (rlbus.consumers.trainer, rlbus.training.join/ordered), with
    the trainer's user: the ordered join, the exactly-once ledger (its Lua scripts), the held-until-checkpoint
    set, the served join, the counters admission reads and its heartbeat. Returns the trained rollout ids."""
    clock = Clock()
    async with run.store("trainer") as state:
        join = OrderedJoin(state=state, policy=RewardPolicy(sources=("verifier",)), batch=2, clock=clock)
        for seq in (1, 0):
            for i in range(2):
                assert await join.add_rollout(rollout(seq, i)) is None
                assert await join.add_reward(reward(seq, i)) is None
        groups = await join.expire()
        assert [g.prompt_id for g in groups] == ["p0000", "p0001"]
        trained = [rid for g in groups for rid in g.rollout_ids]
        await join.hold(1, trained)  # before the step, as the trainer does
        assert await join.settle(1) == len(trained)  # the checkpoint: the ledger's script marks them
        assert await join.recover(1) == []
        assert await join.outcome_of(trained[0]) == [Outcome.TRAINED]
        assert (await join.counts())[Outcome.TRAINED] == len(trained)
        await join.expire()  # every rollout has an outcome: the released groups leave the store
        assert await buffered_rollouts(state) == {}
        # A redelivered rollout is caught by the gate and counted (rlbus.consumers.trainer).
        assert await state.seen(FINAL, trained[0])
        await state.incr(outcome_counter(Outcome.DUPLICATE))
        await state.incr(GROUPS_DONE_COUNTER, len(groups))
        await state.incr(GROUPS_FREED_COUNTER, 0)
        await state.incr(VERSION_COUNTER, 1)
        assert await state.get_counter(VERSION_COUNTER) == 1
        # Online learning: a served rollout waits for its user's rating in the served join.
        served = ServedJoin(ledger=join, state=state, sources=("user",), max_age_s=3600.0, clock=clock)
        assert await served.add_rollout(rollout(7, 0, size=1, served=True)) is None
        released = await served.add_reward(reward(7, 0, source="user"))
        assert released is not None and released.rollout.rollout_id == "p0007/0"
        assert await served.expire() == 0
        beat = Heartbeat(state=state, role="trainer", worker_id="t1", info=lambda: {"step": 1})
        assert await beat.beat() is not None
    return trained


async def test_the_trainer_runs_its_join_and_ledger_with_its_own_user(run: Run, redis_url: str) -> None:
    trained = await trainer_session(run)
    admin = Redis.from_url(redis_url)
    try:
        assert await admin.get(f"{run.prefix}once:{FINAL}:{trained[0]}") == b"1"
        assert await admin.get(f"{run.prefix}ctr:{outcome_counter(Outcome.TRAINED)}") == str(len(trained)).encode()
        assert await admin.exists(f"{run.prefix}worker:trainer:t1")
    finally:
        await admin.aclose()
    # ... and nothing else: the producer's sequence is not the trainer's to move.
    async with run.store("trainer") as state:
        with pytest.raises(StateError, match="no permissions"):
            await state.incr(PROMPT_SEQ)


async def test_the_prompt_producer_keeps_its_sequence_and_reads_what_admission_needs(run: Run) -> None:
    async with run.store("rollout") as rollout_state, run.store("trainer") as trainer_state:
        beat = Heartbeat(state=rollout_state, role="rollout", worker_id="r1", info=lambda: {"version": 3})
        assert await beat.beat() is not None
        await trainer_state.incr(VERSION_COUNTER, 4)
    async with run.store("prompts") as state:
        start = await state.get_counter(PROMPT_SEQ)  # rlbus.launch.roles.prompts_main
        assert await state.incr(PROMPT_SEQ, 5) == start + 5
        progress = await progress_from_state(state, served_by="rollout")()
        assert (progress.version, progress.served) == (4, 3)
        assert await Heartbeat(state=state, role="prompts", worker_id="p1").beat() is not None
        for attempt in (state.incr(VERSION_COUNTER), state.mark_once(FINAL, "x"), state.put_field("k", "f", b"", None),
                        state.heartbeat("rollout", "fake", {"version": 0}, 5.0)):
            with pytest.raises(StateError, match="no permissions"):
                await attempt


@pytest.mark.parametrize("role", HEARTBEAT_ONLY)
async def test_a_worker_heartbeats_but_cannot_touch_the_trainers_ledger(run: Run, redis_url: str, role: str) -> None:
    async with run.store("trainer") as trainer_state:
        assert await trainer_state.mark_once(FINAL, "r-trained")
    ledger, absent = f"{run.prefix}once:{FINAL}:r-trained", f"{run.prefix}once:{FINAL}:r-new"
    async with run.store(role) as state:
        assert await Heartbeat(state=state, role=role, worker_id="w1").beat() is not None
        for attempt in (state.mark_once(FINAL, "r-new"), state.seen(FINAL, "r-trained"),
                        state.mark_once_counted(FINAL, ["r-new"], counter="outcome:trained"),
                        state.incr(VERSION_COUNTER), state.heartbeat("trainer", "fake", {}, 5.0)):
            with pytest.raises(StateError, match="no permissions"):
                await attempt
    client = run.client(role)
    try:
        for command in (("SET", ledger, "0"), ("SET", absent, "1", "NX"), ("DEL", ledger), ("GET", ledger),
                        ("PEXPIRE", ledger, "1"), ("EVAL", "return redis.call('SET', KEYS[1], '0')", "1", ledger)):
            with pytest.raises(NoPermissionError):
                await client.execute_command(*command)
    finally:
        await client.aclose()
    admin = Redis.from_url(redis_url)
    try:
        assert await admin.get(ledger) == b"1" and await admin.pttl(ledger) == -1 and not await admin.exists(absent)
        assert await admin.exists(f"{run.prefix}worker:{role}:w1")
        assert not await admin.exists(f"{run.prefix}worker:trainer:fake")
    finally:
        await admin.aclose()


async def test_the_observer_reads_the_status_and_changes_nothing(run: Run) -> None:
    await trainer_session(run)
    bus = MemoryBus()
    await bus.start()
    try:
        async with run.store("observer") as state:
            snapshot = await take_snapshot(bus=bus, state=state)  # rlbus status
            assert snapshot.trainer["version"] == 1 and [w["role"] for w in snapshot.workers] == ["trainer"]
            for attempt in (state.incr(VERSION_COUNTER), state.get_fields("join:open"), state.seen(FINAL, "x")):
                with pytest.raises(StateError, match="no permissions"):
                    await attempt
    finally:
        await bus.close()


# --- isolation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ROLES)
async def test_a_runs_users_cannot_read_or_write_another_runs_keys(run: Run, other_run: Run, redis_url: str,
                                                                   role: str) -> None:
    await trainer_session(other_run)
    theirs = [f"{other_run.prefix}once:{FINAL}:p0000/0", f"{other_run.prefix}ctr:{VERSION_COUNTER}",
              f"{other_run.prefix}worker:trainer:t1", f"{other_run.prefix}workers"]
    admin = Redis.from_url(redis_url)
    before = {key: await admin.dump(key) for key in theirs}
    client = run.client(role)
    try:
        for key in theirs:
            for command in (("GET", key), ("SET", key, "x"), ("DEL", key), ("EXISTS", key), ("SMEMBERS", key),
                            ("INCRBY", key, "1"), ("RENAME", key, f"{run.prefix}workers")):
                with pytest.raises(NoPermissionError):
                    await client.execute_command(*command)
        # The store pointed at the other run's prefix with this run's user: refused the same way.
        async with run.store(role, key_prefix=other_run.prefix) as state:
            for attempt in (state.seen(FINAL, "p0000/0"), state.get_counter(VERSION_COUNTER), state.workers()):
                with pytest.raises(StateError, match="no permissions"):
                    await attempt
        assert before == {key: await admin.dump(key) for key in theirs} and all(before.values())
    finally:
        await client.aclose()
        await admin.aclose()


@pytest.mark.parametrize("role", NON_OPERATORS)
async def test_no_role_but_the_operator_may_run_an_admin_or_dangerous_command(run: Run, redis_url: str,
                                                                              role: str) -> None:
    """ACL DRYRUN (Redis 7) of every command in @admin and @dangerous, with as many arguments as it needs,
    plus the ones that would hurt the shared server sent for real only where harmless when refused."""
    admin = Redis.from_url(redis_url, decode_responses=True)
    client = run.client(role)
    try:
        commands = sorted({str(c) for cat in ("admin", "dangerous") for c in await admin.acl_cat(cat)})
        assert {"flushall", "config|set", "acl|setuser", "keys", "shutdown"} <= set(commands)
        for command in commands:
            args = await _dry_args(admin, command)
            assert await admin.acl_dryrun(username(role, run.namespace), *args) == (
                f"This user has no permissions to run the '{command}' command"), command
            assert await admin.acl_dryrun(username("operator", run.namespace), *args) in (
                "OK", f"This user has no permissions to access the '{args[-1]}' key"), command
        for sent in (("CONFIG", "GET", "maxmemory-policy"), ("ACL", "LIST"), ("ACL", "USERS"), ("KEYS", "*"),
                     ("SCAN", "0"), ("RANDOMKEY",), ("FUNCTION", "LIST"), ("SCRIPT", "FLUSH"), ("INFO",)):
            with pytest.raises(NoPermissionError):
                await client.execute_command(*sent)
        with pytest.raises(NoPermissionError):
            await client.publish("rlbus", "x")  # no pub/sub channel either
    finally:
        await client.aclose()
        await admin.aclose()


async def _dry_args(admin: Redis, command: str) -> list[str]:
    info: dict[str, Any] = await admin.execute_command("COMMAND", "INFO", command)
    arity = abs(int(next(iter(info.values()))["arity"]))
    parts = command.split("|")
    return parts + ["x"] * (arity - len(parts))


async def test_destructive_commands_are_refused_for_real(private_redis: RedisServer) -> None:
    """On a private server (if a rule were wrong, only it would suffer): FLUSHALL, CONFIG SET, ACL SETUSER,
    SHUTDOWN … sent by every non-operator user are refused and the trainer's ledger is still there."""
    run = await _created(private_redis.url, "runA")
    await trainer_session(run)
    for role in NON_OPERATORS:
        client = run.client(role)
        try:
            for command in (
                ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
                ("ACL", "SETUSER", username(role, "runA"), "+@all", "allkeys"), ("ACL", "DELUSER", "default"),
                ("SHUTDOWN", "NOSAVE"), ("FUNCTION", "FLUSH"), ("SWAPDB", "0", "1"),
                ("CLIENT", "KILL", "TYPE", "normal"), ("MIGRATE", "127.0.0.1", "1", "", "0", "1", "KEYS", "x"),
            ):
                with pytest.raises(NoPermissionError):
                    await client.execute_command(*command)
        finally:
            await client.aclose()
    admin = Redis.from_url(private_redis.url)
    try:
        assert await admin.get(f"{run.prefix}once:{FINAL}:p0000/0") == b"1"
        assert await admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        operator = run.client("operator")
        try:
            assert await operator.acl_whoami() in ("rlbus-runA-operator", b"rlbus-runA-operator")
            assert await operator.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        finally:
            await operator.aclose()
    finally:
        await admin.aclose()


# --- authentication -------------------------------------------------------------------------------------------
async def test_a_wrong_password_is_refused_and_never_shown(run: Run, other_run: Run) -> None:
    wrong = "wrong-" + generate_password()
    client = Redis.from_url(run.url("trainer", password=wrong))
    try:
        with pytest.raises(AuthenticationError) as refused:
            await client.ping()
        assert wrong not in str(refused.value)
    finally:
        await client.aclose()
    # Another run's trainer password does not open this run's trainer, nor this run's another role.
    for url in (run.url("trainer", password=other_run.passwords["trainer"]),
                run.url("rollout", password=run.passwords["trainer"])):
        client = Redis.from_url(url)
        try:
            with pytest.raises(AuthenticationError):
                await client.ping()
        finally:
            await client.aclose()
    store = RedisStateStore.from_url(run.url("trainer", password=wrong), key_prefix=run.prefix)
    try:
        with pytest.raises(StateError) as failed:
            await store.mark_once(FINAL, "x")
        assert wrong not in str(failed.value)
    finally:
        await store.close()


async def test_applying_again_resets_the_rules_and_rotates_the_password(run: Run) -> None:
    admin = Redis.from_url(run.admin_url)
    trainer = username("trainer", run.namespace)
    try:
        before = await admin.acl_getuser(trainer)
        await apply_users(run.admin_url, run.passwords, namespace=run.namespace)
        assert await admin.acl_getuser(trainer) == before  # idempotent
        await admin.acl_setuser(trainer, enabled=True, commands=["+flushall"], keys=["*"])  # drifted by hand
        assert await admin.acl_dryrun(trainer, "flushall") == b"OK"
        old, new = run.passwords["trainer"], generate_password()
        await apply_users(run.admin_url, {"trainer": new}, namespace=run.namespace)
        assert await admin.acl_dryrun(trainer, "flushall") != b"OK"
        assert await admin.acl_getuser(trainer) != before  # only the password hash differs
        run.passwords["trainer"] = new
        await trainer_session(run)
        client = Redis.from_url(run.url("trainer", password=old))
        try:
            with pytest.raises(AuthenticationError):
                await client.ping()
        finally:
            await client.aclose()
    finally:
        await admin.aclose()


async def test_passwords_appear_in_no_log_or_error(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await apply_users(run.admin_url, run.passwords, namespace=run.namespace)
    assert "rlbus-" in caplog.text and "%W~" in caplog.text
    # A user that may not run ACL SETUSER as the admin: refused, and neither its password (in the admin URL)
    # nor the passwords it tried to set are in the error.
    with pytest.raises(StateError, match="no permissions") as refused:
        await apply_users(run.url("rollout"), run.passwords, namespace=run.namespace)
    message = str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    assert not [role for role, password in run.passwords.items() if password in message or password in caplog.text]


# --- the default user ---------------------------------------------------------------------------------------
async def test_turning_default_off_leaves_only_the_role_users(private_redis: RedisServer) -> None:
    """What a production deployment does, on a private server: afterwards a client without credentials is
    refused, the operator administers and the trainer still works."""
    with pytest.raises(ValueError, match="no administrator"):  # no operator, and we are default: refused
        await apply_users(private_redis.url, {"trainer": generate_password()}, namespace="runA",
                          disable_default=True)
    anonymous = Redis.from_url(private_redis.url)
    try:
        assert await anonymous.ping()  # still on
    finally:
        await anonymous.aclose()

    passwords = {role: generate_password() for role in ROLES}
    await apply_users(private_redis.url, passwords, namespace="runA", disable_default=True)
    run = Run(private_redis.url, "runA", passwords)
    anonymous = Redis.from_url(private_redis.url)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.ping()
    finally:
        await anonymous.aclose()
    await trainer_session(run)
    operator = run.client("operator")
    try:
        users = [u.decode() if isinstance(u, bytes) else u for u in await operator.acl_users()]
        assert "rlbus-runA-trainer" in users
        default: Any = await operator.acl_getuser("default")
        assert "off" in [f.decode() if isinstance(f, bytes) else f for f in default["flags"]]
        # The operator can turn default back on and delete the users: it administers the server.
        await operator.acl_setuser("default", enabled=True)
        assert await delete_users(role_url(private_redis.url, "rlbus-runA-operator", passwords["operator"]),
                                  [r for r in ROLES if r != "operator"], namespace="runA") == len(ROLES) - 1
    finally:
        await operator.aclose()


# --- the command line ---------------------------------------------------------------------------------------
def test_the_cli_creates_every_roles_user_and_prints_urls_without_passwords(redis_url: str, tmp_path: Path) -> None:
    import asyncio

    from rlbus.cli.app import app

    namespace = f"acl-cli-{uuid.uuid4().hex[:10]}"
    from_env = "env-password-" + generate_password()
    secrets_dir = tmp_path / "redis-passwords"
    runner = CliRunner()
    try:
        result = runner.invoke(app, ["redis", "users", "--namespace", namespace, "--url", redis_url, "--password-dir",
                                     str(secrets_dir)], env={"RLBUS_REDIS_PASSWORD_OBSERVER": from_env})
        assert result.exit_code == 0, result.output
        passwords = {role: (secrets_dir / role).read_text().strip() for role in ROLES if role != "observer"}
        assert all(stat.S_IMODE((secrets_dir / role).stat().st_mode) == 0o600 for role in passwords)
        assert not (secrets_dir / "observer").exists() and "$RLBUS_REDIS_PASSWORD_OBSERVER" in result.output
        for role in ROLES:
            assert role_url(redis_url, username(role, namespace)) in result.output
        assert not [p for p in [*passwords.values(), from_env] if p in result.output]
        assert result.output.count("(created)") == len(ROLES) - 1

        async def check() -> None:
            run = Run(redis_url, namespace, {**passwords, "observer": from_env})
            await trainer_session(run)
            async with run.store("observer") as state:
                assert await state.get_counter(VERSION_COUNTER) == 1

        asyncio.run(check())
        again = runner.invoke(app, ["redis", "users", "--namespace", namespace, "--url", redis_url,
                                    "--password-dir", str(secrets_dir), "--role", "trainer"])
        assert again.exit_code == 0, again.output
        assert "(created)" not in again.output and (secrets_dir / "trainer").read_text().strip() == passwords["trainer"]
        refused = runner.invoke(app, ["redis", "users", "--namespace", "once", "--url", redis_url,
                                      "--password-dir", str(secrets_dir)])
        assert refused.exit_code != 0 and "key kind" in refused.output
    finally:
        asyncio.run(_clean(redis_url, namespace))


async def test_users_exist_only_while_their_fixture_does(redis_url: str) -> None:
    """The fixture's cleanup: after `delete_users` no user of the namespace is left on the shared server."""
    namespace = f"acl-{uuid.uuid4().hex[:10]}"
    await _created(redis_url, namespace)
    await _clean(redis_url, namespace)
    admin = Redis.from_url(redis_url, decode_responses=True)
    try:
        assert not [u for u in await admin.acl_users() if namespace in u]
    finally:
        await admin.aclose()

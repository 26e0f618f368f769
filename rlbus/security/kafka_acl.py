"""One Kafka principal per role and namespace, allowed exactly what the role does, and nothing else.

A secure cluster (:mod:`rlbus_tools.services.kafka_secure`) refuses whatever no ACL allows. This module says
what each role of a run may do, derived from what its code does (the topics each worker reads and writes
are in ``rlbus/consumers``, ``rlbus/producers``, ``rlbus/serve`` and ``rlbus/weights``):

============  =====================================================  ================================================
role          reads (and its consumer group)                         writes
============  =====================================================  ================================================
trainer       rollouts, rewards (group ``trainer``); weights         weights, weights.latest; dead letters of its inputs
rollout       prompts (group ``rollout``); weights, weights.latest   rollouts; dead letters of prompts
reward        rollouts (groups ``reward-*``)                         rewards; dead letters of rollouts
producer      —                                                      prompts
gateway       weights, weights.latest                                served, rollouts, rewards (users' feedback)
operator      every topic and group of the namespace                 every topic of the namespace (redrive dead letters)
============  =====================================================  ================================================

A rollout worker's credential therefore cannot publish weights, join the trainer's group, or read prompts
it was not sent in another run. Every ACL is LITERAL on the namespaced name (``run7.rl.weights.v1``,
group ``run7.trainer``), except the reward groups and the operator's, which are PREFIXED within the
namespace; so one namespace's principals (``run7.trainer``) can never touch another's topics or groups.
Topics are created by the administrator (``rlbus topics create --acls``), not by roles: no role has
CREATE, ALTER or DELETE.

On a local secure cluster, ``rlbus kafka grant`` (:func:`rlbus_tools.services.kafka_grant.grant`) creates the
roles' SCRAM users and these ACLs with Kafka's Admin client and writes each role's credentials: a password file
(mode 0600) and a ``[bus]`` snippet (:func:`bus_snippet`) that points at it; a container deployment gets them from
``rlbus secrets issue`` (:mod:`rlbus.security.credentials`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlbus.bus.topic import dlq_name
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, SERVED, WEIGHTS, WEIGHTS_LATEST
from rlbus.errors import ConfigError
from rlbus.security.tls import Issued


@dataclass(frozen=True, order=True)
class AclBinding:
    """One ACL: ``principal`` may (or may not) do ``operation`` on a resource (Kafka's names, upper case)."""

    principal: str
    resource_type: str  # TOPIC, GROUP, CLUSTER, TRANSACTIONAL_ID
    name: str
    operation: str  # READ, WRITE, DESCRIBE, CREATE, ALTER, DESCRIBE_CONFIGS, ...
    pattern: str = "LITERAL"  # or PREFIXED
    permission: str = "ALLOW"
    host: str = "*"

    def describe(self) -> str:
        scope = "" if self.pattern == "LITERAL" else f" ({self.pattern.lower()})"
        return f"{self.principal} {self.permission} {self.operation} on {self.resource_type} {self.name}{scope}"


ROLES = ("trainer", "rollout", "reward", "producer", "gateway", "operator")
MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class Grant:
    """What a role may do, in canonical names (the namespace prefix is added by :func:`bindings`)."""

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    #: (group name, pattern): LITERAL names one group, PREFIXED a family of groups.
    groups: tuple[tuple[str, str], ...] = ()


GRANTS: dict[str, Grant] = {
    "trainer": Grant(
        reads=(ROLLOUTS.name, REWARDS.name, WEIGHTS.name, WEIGHTS_LATEST.name),
        writes=(WEIGHTS.name, WEIGHTS_LATEST.name, dlq_name(ROLLOUTS.name), dlq_name(REWARDS.name)),
        groups=(("trainer", "LITERAL"),),
    ),
    "rollout": Grant(
        reads=(PROMPTS.name, WEIGHTS.name, WEIGHTS_LATEST.name),
        writes=(ROLLOUTS.name, dlq_name(PROMPTS.name)),
        groups=(("rollout", "LITERAL"),),
    ),
    "reward": Grant(
        reads=(ROLLOUTS.name,),
        writes=(REWARDS.name, dlq_name(ROLLOUTS.name)),
        groups=(("reward-", "PREFIXED"),),
    ),
    "producer": Grant(writes=(PROMPTS.name,)),
    "gateway": Grant(
        reads=(WEIGHTS.name, WEIGHTS_LATEST.name),
        writes=(SERVED.name, ROLLOUTS.name, REWARDS.name),
    ),
}


def topic_prefix(namespace: str) -> str:
    """``run7`` → ``run7.`` (the prefix :class:`rlbus.bus.namespace.NamespacedBus` gives names)."""
    return f"{namespace}." if namespace else ""


def principal(namespace: str, role: str) -> str:
    """The SCRAM user of ``role`` in ``namespace``: ``run7.trainer`` (``trainer`` without a namespace)."""
    if role not in ROLES:
        raise ConfigError("role", f"{role!r} is not one of {list(ROLES)}")
    return f"{topic_prefix(namespace)}{role}"


def bindings(namespace: str, roles: Iterable[str] = ROLES) -> list[AclBinding]:
    """Every ACL the ``roles`` of ``namespace`` need."""
    prefix = topic_prefix(namespace)
    out: list[AclBinding] = []
    for role in roles:
        user = f"User:{principal(namespace, role)}"
        if role == "operator":
            out += _operator(user, prefix)
            continue
        grant = GRANTS[role]
        out += [AclBinding(user, "TOPIC", prefix + t, "READ") for t in grant.reads]
        out += [AclBinding(user, "TOPIC", prefix + t, "WRITE") for t in grant.writes]
        # DESCRIBE comes with READ and WRITE; producers look up the partitions of what they write.
        out += [AclBinding(user, "GROUP", prefix + g, "READ", pattern) for g, pattern in grant.groups]
    return sorted(set(out))


def _operator(user: str, prefix: str) -> list[AclBinding]:
    # Without a namespace "every topic of the namespace" is every topic: the wildcard resource.
    name, pattern = (prefix, "PREFIXED") if prefix else ("*", "LITERAL")
    topics = [AclBinding(user, "TOPIC", name, op, pattern) for op in ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")]
    groups = [AclBinding(user, "GROUP", name, op, pattern) for op in ("READ", "DESCRIBE")]
    return topics + groups


@dataclass(frozen=True)
class RoleCredential:
    """Where one role's credential lives: its user, password file and ``[bus]`` snippet."""

    role: str
    user: str
    password_file: Path
    bus_file: Path


def bus_snippet(
    bootstrap: str, user: str, password_file: Path, cafile: Path, certificate: Issued | None = None
) -> str:
    """A run config's ``[bus]`` table for one role's credential (no password in it: the file's path); on
    a cluster that requires client certificates, the role's certificate too."""
    mtls = "" if certificate is None else f'ssl_certfile = "{certificate.cert}"\nssl_keyfile = "{certificate.key}"\n'
    return (
        "[bus]\n"
        'kind = "kafka"\n'
        f'bootstrap = "{bootstrap}"\n'
        'security_protocol = "SASL_SSL"\n'
        f'sasl_mechanism = "{MECHANISM}"\n'
        f'sasl_username = "{user}"\n'
        f'sasl_password_file = "{password_file}"\n'
        f'ssl_cafile = "{cafile}"\n'
        f"{mtls}"
    )

"""The Kubernetes manifests (deploy/k8s) render, are valid, and say what rlbus needs — checked offline.

Every overlay (and each optional component added to an overlay, as deploy/k8s/README.md says to add it) is
rendered with the pinned kustomize of infra/k8s/install-kustomize.sh; a missing kustomize fails the test with
the command that installs it. Every object is validated against the Kubernetes schemas of kubernetes-validate
(strict: unknown fields are errors) for the oldest Kubernetes the sandboxed pods run on and the newest the
package ships; KEDA's ScaledObjects and TriggerAuthentications against the JSON Schema written from KEDA's
documentation (deploy/k8s/schemas/keda.schema.yaml). Then what the schemas cannot know: every role runs in the
right regions; each region's pods say their region and run on its nodes; the KEDA triggers name the consumer
groups and topics the workers really use (imported from rlbus, so a rename breaks this test); probes ask the
workers' /healthz; secrets come only from Secret objects; nothing is privileged.

Each check is a function that raises AssertionError; `test_each_check_fails_on_a_broken_manifest` breaks a
rendered manifest once per check and sees it fail, so no check passes vacuously. No cluster is used: what
an API server, KEDA or a kubelet would do with these objects is not tested here (deploy/k8s/README.md).
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from rlbus.bus.base import Bus
from rlbus.bus.topics import PROMPTS, ROLLOUTS, topic_specs
from rlbus.config import KafkaBusConfig
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.rollout import GROUP as ROLLOUT_GROUP
from rlbus.launch.config import RunConfig, load_config
from rlbus.launch.roles import ROLES
from rlbus.security.kafka_acl import MECHANISM, principal
from rlbus_tools.up.secure import KAFKA_ROLE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
INSTALL_SCRIPT = ROOT / "infra" / "k8s" / "install-kustomize.sh"
KEDA_SCHEMA = K8S / "schemas" / "keda.schema.yaml"
#: Kubernetes versions the objects must be valid for: 1.33 turned user namespaces (hostUsers: false, which the
#: sandboxed pods need) on by default; the newest is the newest kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
#: Region overlays; the first is the trainer's region (it adds components/trainer-cluster).
REGIONS = ("eu-west", "us-east")
TRAINER_REGION = "eu-west"
#: The roles that run once per run, in the trainer's region; every other role runs in every region.
CENTRAL = {"trainer", "prompts", "blobs"}
#: Roles whose pods run untrusted code under bubblewrap (their own user namespace, unconfined seccomp).
SANDBOXED = {"rollout", "reward"}
IMAGE_UID = 10001  # the Dockerfile's user rlbus
METRICS_PORT = 9400
#: What may hold a secret value: only valueFrom.secretKeyRef may set such a variable.
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|CREDENTIAL|_KEY$|_KEYS$")
#: The Secret every base pod reads, and its keys (deploy/k8s/README.md creates it with exactly these).
APP_SECRET = "rlbus"
APP_SECRET_KEYS = {"blob-secret", "metrics-token", "serve-tokens"}

#: What stands in for a secret's value where the run config parses it (any token stands in for the others).
SECRET_STAND_INS = {"RLBUS_REDIS_URL": "redis://role:stand-in@redis.invalid:6379/0"}

Doc = dict[str, Any]


# --- rendering ------------------------------------------------------------------------------------------
def pinned_version() -> str:
    """The kustomize version infra/k8s/install-kustomize.sh installs (its one owner)."""
    found = re.search(r'^KUSTOMIZE_VERSION="(v[0-9.]+)"', INSTALL_SCRIPT.read_text(), re.MULTILINE)
    assert found, f"{INSTALL_SCRIPT} no longer pins KUSTOMIZE_VERSION"
    return found.group(1)


def kustomize() -> Path:
    """The pinned kustomize where the install script puts it; fails (never skips) when it is not there."""
    binary = Path(os.environ.get("RLBUS_HOME") or Path.home() / ".cache" / "rlbus") / "bin" / "kustomize"
    install = f"bash {INSTALL_SCRIPT.relative_to(ROOT)}"
    if not binary.is_file():
        pytest.fail(f"kustomize is not installed at {binary}: run `{install}`")
    version = subprocess.run([binary, "version"], capture_output=True, text=True, check=False).stdout.strip()
    if version != pinned_version():
        pytest.fail(f"{binary} is kustomize {version or '(unknown)'}, not {pinned_version()}: run `{install}`")
    return binary


def build(directory: Path) -> list[Doc]:
    run = subprocess.run([kustomize(), "build", directory], capture_output=True, text=True, check=False)
    assert run.returncode == 0, f"kustomize build {directory} failed:\n{run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def build_with(tmp: Path, overlay: str, component: str) -> list[Doc]:
    """``overlay`` with ``component`` added to its components, as the README says to add it (in a copy)."""
    tree = tmp / "k8s"
    shutil.copytree(K8S, tree)
    kustomization = tree / "overlays" / overlay / "kustomization.yaml"
    spec = yaml.safe_load(kustomization.read_text())
    spec["components"] = [*spec.get("components", []), f"../../components/{component}"]
    kustomization.write_text(yaml.safe_dump(spec, sort_keys=False))
    return build(tree / "overlays" / overlay)


#: What is rendered: each region, and each optional component on a region.
VARIANTS = [*REGIONS, *(f"{region}+secure" for region in REGIONS), f"{TRAINER_REGION}+gateway-ingress"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    out = {}
    for variant in VARIANTS:
        overlay, _, component = variant.partition("+")
        out[variant] = (build_with(tmp_path_factory.mktemp(variant), overlay, component) if component
                        else build(K8S / "overlays" / overlay))
    return out


def region_of(variant: str) -> str:
    return variant.partition("+")[0]


# --- reading rendered objects ------------------------------------------------------------------------
def objects(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def the(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [doc for doc in objects(docs, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")]


def pod(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def role(workload: Doc) -> str:
    """The rlbus role a workload's first container runs: `rlbus worker <role>`, or blobs for the blob store."""
    command = pod(workload)["containers"][0]["command"]
    if command[:3] == ["rlbus", "blobs", "serve"]:
        return "blobs"
    assert command[:2] == ["rlbus", "worker"] and len(command) == 3, f"unexpected command {command}"
    return command[2]


def by_role(docs: list[Doc]) -> dict[str, Doc]:
    out: dict[str, Doc] = {}
    for workload in workloads(docs):
        assert role(workload) not in out, f"two workloads run {role(workload)}"
        out[role(workload)] = workload
    return out


def env_of(docs: list[Doc], container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env (which wins).
    A variable from a Secret reads ``secret:<name>/<key>``, from a field ``field:<path>``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(the(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            env[var["name"]] = f"secret:{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}"
        elif "configMapKeyRef" in ref:
            cm = the(docs, "ConfigMap", ref["configMapKeyRef"]["name"])
            env[var["name"]] = cm["data"][ref["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = f"field:{ref['fieldRef']['fieldPath']}"
    return env


def mounted_file(docs: list[Doc], workload: Doc, path: str) -> str:
    """The text of the file at ``path`` in the workload's first container, from a mounted ConfigMap."""
    spec = pod(workload)
    for mount in spec["containers"][0].get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert "configMap" in volume, f"{path} is not from a ConfigMap"
            return the(docs, "ConfigMap", volume["configMap"]["name"])["data"][path[len(prefix):]]
    raise AssertionError(f"nothing is mounted at {path}")


def run_config(docs: list[Doc], workload: Doc) -> RunConfig:
    """The run config the workload's pod loads: RLBUS_CONFIG (and RLBUS_BUS_CONFIG, where set) as mounted
    from their ConfigMaps, under the pod's environment."""
    env = env_of(docs, pod(workload)["containers"][0])
    # the secrets' values are the cluster's; well-formed ones stand in for them here
    environ = {k: (SECRET_STAND_INS.get(k, "x" * 32) if v.startswith("secret:") else v) for k, v in env.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("RLBUS_CONFIG", "RLBUS_BUS_CONFIG"):
            if name in env:
                path = Path(tmp) / name
                path.write_text(mounted_file(docs, workload, env[name]))
                environ[name] = str(path)
        return load_config(Path(environ["RLBUS_CONFIG"]), environ=environ)


def port_number(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    assert numbers, f"container {container['name']} declares no port {port}"
    return numbers[0]


def containers(workload: Doc) -> Iterator[Doc]:
    spec = pod(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


# --- the checks: each raises AssertionError -----------------------------------------------------------
def check_kubernetes_schemas(docs: list[Doc]) -> None:
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}) at "
                                     f"{where}: {exc.message}") from None
            except kubernetes_validate.SchemaNotFoundError as exc:
                raise AssertionError(exc.message) from None


def keda_validator() -> jsonschema.Draft202012Validator:
    schema = yaml.safe_load(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def check_keda_schema(docs: list[Doc]) -> None:
    validator = keda_validator()
    keda = [doc for doc in docs if doc["apiVersion"].startswith("keda.sh/")]
    assert {doc["kind"] for doc in keda} <= {"ScaledObject", "TriggerAuthentication"}, "a KEDA kind with no schema"
    for doc in keda:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(
            f"{'/'.join(str(p) for p in e.path)}: {e.message}" for e in errors)
        spec = doc["spec"]
        if doc["kind"] == "ScaledObject":
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), "min above max"
            if "idleReplicaCount" in spec:
                assert spec["idleReplicaCount"] < spec.get("minReplicaCount", 0), "idle not below min"


def check_roles(docs: list[Doc], region: str) -> None:
    roles = set(by_role(docs))
    expected = (set(ROLES) | {"blobs"}) - (set() if region == TRAINER_REGION else CENTRAL)
    assert roles == expected, f"{region} runs {sorted(roles)}, not {sorted(expected)}"
    for name, workload in by_role(docs).items():
        kind = "StatefulSet" if name == "trainer" else "Deployment"
        assert workload["kind"] == kind, f"{name} is a {workload['kind']}, not a {kind}"


def check_region(docs: list[Doc], region: str) -> None:
    namespace = f"rlbus-{region}"
    for doc in docs:
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == namespace
        else:
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"
    for workload in workloads(docs):
        name = workload["metadata"]["name"]
        if role(workload) != "blobs":
            assert env_of(docs, pod(workload)["containers"][0]).get("RLBUS_REGION") == region, f"{name}: region"
        terms = (pod(workload).get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
        assert terms and all(
            {"key": "topology.kubernetes.io/region", "operator": "In", "values": [region]} in term["matchExpressions"]
            for term in terms), f"{name} is not held to nodes of {region}"


def expected_scaling(config: RunConfig) -> dict[str, tuple[str, str]]:
    """role → (consumer group, topic) the KEDA trigger must name, from rlbus's own definitions and the
    run's namespace prefix (rlbus.bus.namespace): what the workers of this run config join."""
    prefix = config.topic_prefix
    # RewardWorker.group is a property of the worker's kind: read it off the class, not a copy of its format
    reward_group = RewardWorker.group.fget(SimpleNamespace(kind=config.reward.kind))  # type: ignore[attr-defined]
    return {"rollout": (prefix + ROLLOUT_GROUP, prefix + PROMPTS.name),
            "reward": (prefix + reward_group, prefix + ROLLOUTS.name)}


def check_keda_targets(docs: list[Doc]) -> None:
    workers = by_role(docs)
    scaled = {}
    for so in objects(docs, "ScaledObject"):
        ref = so["spec"]["scaleTargetRef"]
        assert ref.get("apiVersion", "apps/v1") == "apps/v1" and ref.get("kind", "Deployment") == "Deployment"
        target = the(docs, "Deployment", ref["name"])
        scaled[role(target)] = (so, target)
    assert set(scaled) == {"rollout", "reward"}, f"KEDA scales {sorted(scaled)}"
    from_beginning = inspect.signature(Bus.consumer).parameters["from_beginning"].default
    for name, (so, target) in scaled.items():
        env = env_of(docs, pod(target)["containers"][0])
        group, topic = expected_scaling(run_config(docs, workers[name]))[name]
        [trigger] = [t for t in so["spec"]["triggers"] if t["type"] == "kafka"]
        meta = trigger["metadata"]
        assert (meta["consumerGroup"], meta.get("topic")) == (group, topic), (
            f"{name}: KEDA watches group {meta['consumerGroup']} on {meta.get('topic')}, the workers join {group} "
            f"on {topic}")
        assert meta["bootstrapServers"] == env["RLBUS_KAFKA_BOOTSTRAP"], f"{name}: KEDA asks another Kafka"
        assert meta.get("offsetResetPolicy", "latest") == ("earliest" if from_beginning else "latest")
        assert so["spec"].get("minReplicaCount", 0) >= 1, f"{name}: scaled to zero, nothing would wake it"


def check_partitions(regions: dict[str, list[Doc]]) -> None:
    """One group spans the regions: together they never hold more members than the topic has partitions."""
    partitions = {spec.name: spec.partitions for spec in topic_specs()}
    ceiling: dict[str, int] = {}
    for docs in regions.values():
        for so in objects(docs, "ScaledObject"):
            topic = so["spec"]["triggers"][0]["metadata"]["topic"]
            ceiling[topic] = ceiling.get(topic, 0) + so["spec"].get("maxReplicaCount", 100)
    for topic, total in ceiling.items():
        [name] = [name for name in partitions if topic == name or topic.endswith(f".{name}")]
        assert total <= partitions[name], f"{topic}: up to {total} members for {partitions[name]} partitions"


def check_probes(docs: list[Doc]) -> None:
    for workload in workloads(docs):
        container = pod(workload)["containers"][0]
        name = workload["metadata"]["name"]
        env = env_of(docs, container)
        for kind in ("livenessProbe", "readinessProbe"):
            probe = container.get(kind)
            assert probe and "httpGet" in probe, f"{name}: no HTTP {kind}"
            assert probe["httpGet"]["path"] == "/healthz", f"{name}: {kind} asks {probe['httpGet']['path']}"
            port = port_number(container, probe["httpGet"]["port"])
            if role(workload) == "blobs":
                assert port == 8470, f"{name}: {kind} on {port}"
            elif not (role(workload) == "serve" and kind == "readinessProbe"):
                assert port == int(env["RLBUS_METRICS_PORT"]) == METRICS_PORT, f"{name}: {kind} on {port}"
        if role(workload) == "serve":
            port = port_number(container, container["readinessProbe"]["httpGet"]["port"])
            assert port == run_config(docs, workload).serve.port, f"{name}: readiness not on the gateway's port"


def literal_values(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from literal_values(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from literal_values(value, f"{path}/{i}")
    elif isinstance(node, str):
        yield path, node


def check_secrets(docs: list[Doc]) -> None:
    assert not objects(docs, "Secret"), "a Secret in the rendered output: secrets are created in the cluster"
    for workload in workloads(docs):
        for container in containers(workload):
            for var in container.get("env", []):
                if SECRET_NAME.search(var["name"]):
                    assert "secretKeyRef" in var.get("valueFrom", {}), (
                        f"{workload['metadata']['name']}: {var['name']} is not from a Secret")
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] == APP_SECRET:
                    assert ref["key"] in APP_SECRET_KEYS, f"Secret {APP_SECRET} has no key {ref['key']}"
            env = env_of(docs, container)
            for name in ("RLBUS_REDIS_URL", "RLBUS_BLOB_URL", "RLBUS_KAFKA_BOOTSTRAP"):
                if name in env and not env[name].startswith("secret:"):
                    assert "@" not in env[name], f"{name} carries a credential in a ConfigMap or literal"
    for cm in objects(docs, "ConfigMap"):
        for key in cm.get("data", {}):
            assert not SECRET_NAME.search(key.upper()), f"ConfigMap {cm['metadata']['name']} holds {key}"
        for key, text in cm.get("data", {}).items():
            if key.endswith(".toml"):
                found = [k for k, _ in literal_values(tomllib.loads(text))
                         if re.search(r"password|secret|token", k.rpartition("/")[2]) and not k.endswith("_file")]
                assert not found, f"{cm['metadata']['name']}/{key} holds {found}"
    # the development defaults of docker-compose.yml (local-dev-…) never reach a cluster
    defaults = re.findall(r"\$\{(RLBUS_\w+):-([^}]+)\}", (ROOT / "docker-compose.yml").read_text())
    dev = {"local-dev", *(value for name, value in defaults if SECRET_NAME.search(name))}
    for doc in docs:
        for where, value in literal_values(doc):
            assert not any(secret in value for secret in dev), f"{doc['metadata']['name']}{where}: a dev secret"


def check_unprivileged(docs: list[Doc]) -> None:
    accounts = {sa["metadata"]["name"]: sa for sa in objects(docs, "ServiceAccount")}
    for workload in workloads(docs):
        name, spec = workload["metadata"]["name"], pod(workload)
        sandboxed = role(workload) in SANDBOXED
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(field), f"{name}: {field}"
        account = spec.get("serviceAccountName")
        assert account in accounts and accounts[account].get("automountServiceAccountToken") is False, (
            f"{name}: its own ServiceAccount without a token")
        assert spec.get("automountServiceAccountToken") is False, f"{name} mounts an API token"
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser") == IMAGE_UID, f"{name}: uid"
        seccomp = pod_sc.get("seccompProfile", {}).get("type")
        assert seccomp == ("Unconfined" if sandboxed else "RuntimeDefault"), f"{name}: seccomp {seccomp}"
        if sandboxed:
            assert spec.get("hostUsers") is False, f"{name}: bubblewrap without a user namespace of its own"
        for container in containers(workload):
            sc = container.get("securityContext", {})
            assert sc.get("privileged") is not True, f"{name}/{container['name']} is privileged"
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}/{container['name']}: escalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities kept"
            assert not sc.get("capabilities", {}).get("add"), f"{name}: capabilities added"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name}/{container['name']}: writable root"
            assert sc.get("runAsUser", IMAGE_UID) == IMAGE_UID and sc.get("runAsNonRoot", True) is True
            assert (sc.get("procMount", "Default") == "Unmasked") == sandboxed, f"{name}: procMount"
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{name}: no {bound}"


def check_run_config(docs: list[Doc]) -> None:
    """The pods load a valid run config, a copy of infra/rlbus/run.toml but for where runs are written; the
    trainer writes them on its own volume."""
    base = tomllib.loads((K8S / "base" / "run.toml").read_text())
    compose = tomllib.loads((ROOT / "infra" / "rlbus" / "run.toml").read_text())
    moved = {("run", "run_dir"), ("trainer", "checkpoint_dir")}
    for table, key in moved:
        assert base[table].pop(key).startswith("/data/runs/")
        compose[table].pop(key)
    assert base == compose, "deploy/k8s/base/run.toml differs from infra/rlbus/run.toml"
    for workload in workloads(docs):
        if role(workload) != "blobs":
            run_config(docs, workload)  # raises ConfigError on anything rlbus refuses
    trainer = by_role(docs).get("trainer")
    if trainer is not None:
        config = run_config(docs, trainer)
        claims = {t["metadata"]["name"] for t in trainer["spec"].get("volumeClaimTemplates", [])}
        mounts = pod(trainer)["containers"][0]["volumeMounts"]
        for path in (config.trainer.checkpoint_dir, config.run_dir):
            assert any(str(path).startswith(m["mountPath"].rstrip("/") + "/") and m["name"] in claims
                       for m in mounts), f"the trainer writes {path} outside its volume"


def check_trainer_group(docs: list[Doc]) -> None:
    trainer = the(docs, "StatefulSet", "trainer")
    spec = trainer["spec"]
    service = the(docs, "Service", spec["serviceName"])
    assert service["spec"].get("clusterIP") == "None", "the ranks' Service is not headless"
    assert spec.get("podManagementPolicy") == "Parallel", "the ranks do not start together"
    env = env_of(docs, pod(trainer)["containers"][0])
    assert env["PET_NNODES"] == str(spec.get("replicas", 1)), "PET_NNODES is not the number of ranks"
    assert env["PET_MASTER_ADDR"] == f"{trainer['metadata']['name']}-0.{spec['serviceName']}"
    assert env["PET_NODE_RANK"] == "field:metadata.labels['apps.kubernetes.io/pod-index']"


def check_gateway(docs: list[Doc]) -> None:
    serve = by_role(docs)["serve"]
    service = the(docs, "Service", "serve")
    assert service["spec"].get("sessionAffinity") == "ClientIP", "the gateway's Service has no client affinity"
    labels = serve["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), "the Service selects no gateway pod"
    container = pod(serve)["containers"][0]
    [port] = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == run_config(docs, serve).serve.port
    for ingress in objects(docs, "Ingress"):
        annotations = ingress["metadata"].get("annotations", {})
        assert annotations.get("nginx.ingress.kubernetes.io/upstream-hash-by") == "$http_x_rl_session", (
            "the ingress does not hash on X-RL-Session")
        backends = [p["backend"]["service"]["name"] for rule in ingress["spec"]["rules"]
                    for p in rule["http"]["paths"]]
        assert backends == ["serve"], backends


def check_secure(docs: list[Doc]) -> None:
    auths = {ta["metadata"]["name"]: ta for ta in objects(docs, "TriggerAuthentication")}
    for so in objects(docs, "ScaledObject"):
        [trigger] = so["spec"]["triggers"]
        assert trigger["metadata"].get("sasl") == "scram_sha512" and trigger["metadata"].get("tls") == "enable", (
            f"KEDA's {so['metadata']['name']} trigger is not SCRAM-SHA-512 over TLS")
        auth = auths[trigger["authenticationRef"]["name"]]
        assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} >= {"username", "password", "ca"}
    for name, workload in by_role(docs).items():
        if name == "blobs":
            continue
        env = env_of(docs, pod(workload)["containers"][0])
        bus = tomllib.loads(mounted_file(docs, workload, env["RLBUS_BUS_CONFIG"]))["bus"]
        settings = msgspec.convert({**bus, "sasl_username": env["RLBUS_SASL_USERNAME"]}, KafkaBusConfig)
        assert settings.security_protocol == "SASL_SSL" and settings.sasl_mechanism == MECHANISM, name
        user = principal(run_config(docs, workload).run.namespace, KAFKA_ROLE[name])
        assert env["RLBUS_SASL_USERNAME"] == user, f"{name} is Kafka user {env['RLBUS_SASL_USERNAME']}, not {user}"
        assert env["RLBUS_SASL_PASSWORD"].startswith("secret:") and env["RLBUS_REDIS_URL"].startswith("secret:")
        ca = next(m for m in pod(workload)["containers"][0]["volumeMounts"]
                  if settings.ssl_cafile and settings.ssl_cafile.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod(workload)["volumes"] if v["name"] == ca["name"])
        assert "secret" in volume, f"{name}: the Kafka CA is not from a Secret"


# --- the tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_objects_are_valid_kubernetes(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_kubernetes_schemas(rendered[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_keda_objects_follow_kedas_spec(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_keda_schema(rendered[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_region_runs_its_roles_on_its_nodes(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_roles(rendered[variant], region_of(variant))
    check_region(rendered[variant], region_of(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_keda_scales_on_the_groups_the_workers_join(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_keda_targets(rendered[variant])


def test_regions_together_stay_within_the_partitions(rendered: dict[str, list[Doc]]) -> None:
    check_partitions({region: rendered[region] for region in REGIONS})


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_ask_healthz(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_probes(rendered[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_secrets_come_only_from_secret_objects(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_secrets(rendered[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_nothing_is_privileged(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_unprivileged(rendered[variant])


@pytest.mark.parametrize("variant", REGIONS)
def test_pods_load_the_run_config(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_run_config(rendered[variant])


def test_the_trainers_ranks_are_one_pod_group(rendered: dict[str, list[Doc]]) -> None:
    check_trainer_group(rendered[TRAINER_REGION])


@pytest.mark.parametrize("variant", [*REGIONS, f"{TRAINER_REGION}+gateway-ingress"])
def test_the_gateway_keeps_sessions_on_one_replica(rendered: dict[str, list[Doc]], variant: str) -> None:
    check_gateway(rendered[variant])
    assert objects(rendered[variant], "Ingress") or "+" not in variant


@pytest.mark.parametrize("region", REGIONS)
def test_the_secure_component_gives_each_role_its_credential(rendered: dict[str, list[Doc]], region: str) -> None:
    check_secure(rendered[f"{region}+secure"])


def test_the_readme_creates_the_secret_the_pods_read() -> None:
    readme = (K8S / "README.md").read_text()
    assert re.search(rf"kubectl (-n \S+ )?create secret generic {APP_SECRET} ", readme), "no Secret is created"
    for key in APP_SECRET_KEYS:
        assert f"--from-literal={key}=" in readme, f"the README's Secret lacks {key}"
    assert f"bash {INSTALL_SCRIPT.relative_to(ROOT)}" in readme


# --- every check can fail -------------------------------------------------------------------------------
def _workload(docs: list[Doc], name: str) -> Doc:
    return next(w for w in workloads(docs) if w["metadata"]["name"] == name)


def _set_env(docs: list[Doc], name: str, var: str, value: str) -> None:
    env = pod(_workload(docs, name))["containers"][0].setdefault("env", [])
    env[:] = [v for v in env if v["name"] != var] + [{"name": var, "value": value}]


def _trigger(docs: list[Doc], name: str) -> Doc:
    return the(docs, "ScaledObject", name)["spec"]["triggers"][0]


#: (check, variant, how to break the rendered manifest) — each must make the check fail.
BREAKS: list[tuple[Callable[..., None], str, Callable[[list[Doc]], None]]] = [
    (check_kubernetes_schemas, "eu-west",
     lambda d: pod(_workload(d, "rollout"))["containers"][0].update(imagePullPolicyy="Always")),
    (check_kubernetes_schemas, "eu-west", lambda d: the(d, "Service", "serve")["spec"].update(sessionAffinity=7)),
    (check_keda_schema, "eu-west", lambda d: _trigger(d, "rollout")["metadata"].update(allowIdleConsumers=False)),
    (check_keda_schema, "eu-west", lambda d: _trigger(d, "reward")["metadata"].update(consumergroup="reward")),
    (check_keda_schema, "eu-west", lambda d: the(d, "ScaledObject", "reward")["spec"].update(maxReplicaCount=0)),
    (check_keda_schema, "eu-west+secure",
     lambda d: the(d, "TriggerAuthentication", "rlbus-kafka")["spec"]["secretTargetRef"][0].update(parameter="user")),
    (check_roles, "us-east", lambda d: d.remove(_workload(d, "reward"))),
    (check_roles, "us-east", lambda d: d.append(copy.deepcopy(_workload(d, "rollout")) | {"kind": "StatefulSet"})),
    (check_region, "us-east", lambda d: the(d, "ConfigMap", next(
        c["metadata"]["name"] for c in objects(d, "ConfigMap") if "RLBUS_REGION" in c["data"]))["data"].update(
        RLBUS_REGION="eu-west")),
    (check_region, "eu-west", lambda d: pod(_workload(d, "trainer")).pop("affinity")),
    (check_keda_targets, "eu-west", lambda d: _trigger(d, "rollout")["metadata"].update(consumerGroup="rollouts")),
    (check_keda_targets, "eu-west", lambda d: _trigger(d, "reward")["metadata"].update(topic=PROMPTS.name)),
    (check_keda_targets, "us-east", lambda d: _trigger(d, "reward")["metadata"].update(bootstrapServers="k:9092")),
    (check_keda_targets, "eu-west", lambda d: _set_env(d, "reward", "RLBUS_NAMESPACE", "run7")),
    (check_probes, "eu-west",
     lambda d: pod(_workload(d, "reward"))["containers"][0]["livenessProbe"]["httpGet"].update(path="/metrics")),
    (check_probes, "eu-west",
     lambda d: pod(_workload(d, "trainer"))["containers"][0]["readinessProbe"]["httpGet"].update(port=8000)),
    (check_secrets, "eu-west", lambda d: _set_env(d, "serve", "RLBUS_SERVE_TOKENS", "t:abcdefabcdefabcdef")),
    (check_secrets, "eu-west", lambda d: d.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}})),
    (check_secrets, "us-east", lambda d: _set_env(d, "rollout", "RLBUS_REDIS_URL", "redis://u:p@redis:6379/0")),
    (check_secrets, "eu-west", lambda d: _set_env(d, "prompts", "RLBUS_LOG_LEVEL", "local-dev-secret")),
    (check_unprivileged, "eu-west",
     lambda d: pod(_workload(d, "serve"))["containers"][0]["securityContext"].update(privileged=True)),
    (check_unprivileged, "us-east", lambda d: pod(_workload(d, "rollout")).pop("hostUsers")),
    (check_unprivileged, "eu-west",
     lambda d: pod(_workload(d, "trainer"))["securityContext"]["seccompProfile"].update(type="Unconfined")),
    (check_unprivileged, "eu-west", lambda d: the(d, "ServiceAccount", "blobs").pop("automountServiceAccountToken")),
    (check_run_config, "eu-west", lambda d: pod(_workload(d, "trainer"))["containers"][0]["volumeMounts"].pop(1)),
    (check_trainer_group, "eu-west", lambda d: the(d, "StatefulSet", "trainer")["spec"].update(replicas=2)),
    (check_gateway, "eu-west", lambda d: the(d, "Service", "serve")["spec"].pop("sessionAffinity")),
    (check_gateway, "eu-west+gateway-ingress", lambda d: the(d, "Ingress", "serve")["metadata"]["annotations"].update(
        {"nginx.ingress.kubernetes.io/upstream-hash-by": "$remote_addr"})),
    (check_secure, "us-east+secure", lambda d: _set_env(d, "rollout", "RLBUS_SASL_USERNAME", "trainer")),
    (check_secure, "eu-west+secure", lambda d: _trigger(d, "reward")["metadata"].pop("tls")),
]


def _call(check: Callable[..., None], docs: list[Doc], variant: str) -> None:
    if "region" in inspect.signature(check).parameters:
        check(docs, region_of(variant))
    else:
        check(docs)


@pytest.mark.parametrize(("check", "variant", "breaking"), BREAKS,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(BREAKS)])
def test_each_check_fails_on_a_broken_manifest(
    rendered: dict[str, list[Doc]], check: Callable[..., None], variant: str, breaking: Callable[[list[Doc]], None],
) -> None:
    docs = copy.deepcopy(rendered[variant])
    _call(check, docs, variant)  # passes as rendered …
    breaking(docs)
    with pytest.raises(AssertionError):
        _call(check, docs, variant)  # … and fails once broken


def test_the_partition_check_fails_past_the_partitions(rendered: dict[str, list[Doc]]) -> None:
    regions = {region: copy.deepcopy(rendered[region]) for region in REGIONS}
    the(regions["us-east"], "ScaledObject", "rollout")["spec"]["maxReplicaCount"] = 7
    with pytest.raises(AssertionError):
        check_partitions(regions)

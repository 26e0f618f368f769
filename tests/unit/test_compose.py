"""docker-compose.yml stays valid: `docker compose config` accepts it with and without the cluster profile.

Skipped only where no docker client is installed. Where the client lacks the compose plugin,
Debian's standalone ``docker-compose`` (which .ci/run installs) does the validation instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
#: The distributed run's services and the role each runs.
WORKERS = {"trainer": "trainer", "rollout": "rollout", "rollout-us": "rollout", "reward": "reward",
           "prompts": "prompts", "serve": "serve", "serve-us": "serve"}
DEFAULT = {"kafka", "topics", "redis", "blobs", *WORKERS}
CLUSTER = DEFAULT | {"kafka-1", "kafka-2", "kafka-3", "topics-cluster"}


def _compose_command() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("no docker client installed")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("the docker client has no compose: install the compose plugin or Debian's docker-compose")


def _compose(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"}
    command = [*_compose_command(), "-f", str(COMPOSE_FILE), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("profile", [[], ["--profile", "cluster"]], ids=["default", "cluster"])
def test_compose_file_is_valid(profile: list[str]) -> None:
    _compose(*profile, "config", "-q")


def test_compose_services() -> None:
    default = set(_compose("config", "--services").split())
    cluster = set(_compose("--profile", "cluster", "config", "--services").split())
    # Compose v1 lists every service regardless of profile; v2 lists only the enabled ones.
    assert DEFAULT <= default <= CLUSTER
    assert cluster == CLUSTER


def test_worker_services_run_one_role_each_with_the_mounted_config() -> None:
    import yaml

    services = yaml.safe_load(_compose("config"))["services"]
    regions = {}
    for name, role in WORKERS.items():
        service = services[name]
        assert service["command"][:3] == ["rlbus", "worker", role], name
        env = service["environment"]
        assert env["RLBUS_CONFIG"] == "/etc/rlbus/run.toml" and env["RLBUS_KAFKA_BOOTSTRAP"] == "kafka:19092"
        assert any(str(v).endswith("/etc/rlbus/run.toml:ro") for v in service["volumes"])
        assert "9400" in [str(p) for p in service["expose"]]
        assert not any("secret" in str(arg).lower() for arg in service["command"])  # secrets: environment only
        regions[name] = env.get("RLBUS_REGION")
    assert regions["rollout"] and regions["rollout-us"] and regions["rollout"] != regions["rollout-us"]
    assert "container_name" not in services["rollout"] and "ports" not in services["rollout"]  # --scale works
    assert services["blobs"]["command"][:3] == ["rlbus", "blobs", "serve"]


def test_gateways_serve_per_region_and_scale() -> None:
    import yaml

    services = yaml.safe_load(_compose("config"))["services"]
    regions = {services[name]["environment"]["RLBUS_REGION"] for name in ("serve", "serve-us")}
    assert len(regions) == 2
    for name in ("serve", "serve-us"):
        assert "8000" in [str(p) for p in services[name]["expose"]] and "ports" not in services[name]
        assert services[name]["environment"]["RLBUS_SERVE_TOKENS"]  # tokens from the environment, not the command

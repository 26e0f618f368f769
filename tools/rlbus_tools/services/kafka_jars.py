"""The Kafka release rlbus runs: the pom that pins it, and its runtime jars resolved by Maven into a cache.

Split from :mod:`rlbus_tools.services.kafka` so that the cluster manager and the Admin-client tool
(:mod:`rlbus_tools.services.kafka_admin`) share one classpath without importing each other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import rlbus
from rlbus.errors import ServiceError

_POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}
LOG_TAIL_LINES = 30


# --- locations -------------------------------------------------------------------------------


def default_home() -> Path:
    """``$RLBUS_HOME`` or ``~/.cache/rlbus``: the jar cache and the default cluster home."""
    return Path(os.environ.get("RLBUS_HOME") or Path.home() / ".cache" / "rlbus").expanduser()


def pom_path() -> Path:
    """The pom that pins the broker: ``$RLBUS_KAFKA_POM`` or ``<repo>/infra/kafka/pom.xml``."""
    override = os.environ.get("RLBUS_KAFKA_POM")
    pom = Path(override) if override else Path(rlbus.__file__).resolve().parents[1] / "infra/kafka/pom.xml"
    if not pom.is_file():
        raise ServiceError(f"Kafka pom not found at {pom}; set RLBUS_KAFKA_POM to infra/kafka/pom.xml")
    return pom


def kafka_version(pom: Path) -> str:
    """The ``kafka.version`` property of the pom."""
    node = ET.parse(pom).getroot().find("m:properties/m:kafka.version", _POM_NS)
    if node is None or not node.text:
        raise ServiceError(f"{pom} has no <kafka.version> property")
    return node.text.strip()


def require_program(program: str, package: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise ServiceError(f"{program!r} not found on PATH; install it (Debian: apt-get install -y {package})")
    return path


# --- jars ------------------------------------------------------------------------------------


def resolve_jars(cache_dir: Path | None = None) -> Path:
    """Resolve the broker's runtime jars with Maven into ``<cache>/kafka-<version>/jars``.

    Skipped when the marker file records the same pom, so later calls cost nothing.
    """
    pom = pom_path()
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    jars = (cache_dir or default_home()).expanduser() / f"kafka-{kafka_version(pom)}" / "jars"
    marker = jars / ".resolved"
    if marker.is_file() and marker.read_text().strip() == digest:
        return jars
    jars.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars.", dir=jars.parent))
    try:
        _run_maven(pom, staging)
        (staging / ".resolved").write_text(digest + "\n")
        shutil.rmtree(jars, ignore_errors=True)
        staging.rename(jars)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return jars


def _run_maven(pom: Path, output_dir: Path) -> None:
    command = [
        require_program("mvn", "maven"),
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={output_dir}",
        "-DincludeScope=runtime",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ServiceError(f"Maven could not resolve the Kafka jars:\n{tail(done.stdout + done.stderr)}")


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a JVM's output, without stack frames, so exception messages show."""
    kept = [line for line in text.splitlines() if not line.lstrip().startswith(("at ", "... "))]
    return "\n".join(kept[-lines:])

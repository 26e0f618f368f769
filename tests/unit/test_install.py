"""The one list of system packages (``infra/system-packages.txt``): ``make test`` and ``.ci/run`` both install
through ``infra/install-deps.sh``, which reads it, and it covers every program the code and tests look up."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "infra" / "system-packages.txt"
SCRIPT = ROOT / "infra" / "install-deps.sh"
#: Looked up but not a system package of the tests: the package's own script, the installer, and the docker
#: client (tests/unit/test_compose.py runs only where one is installed; the list then adds its compose).
NOT_PACKAGES = {"rlbus", "apt-get", "docker"}


def entries() -> dict[str, str]:
    """Package → the shell test that says it is present."""
    lines = [line.strip() for line in LIST.read_text().splitlines()]
    pairs = [line.split(maxsplit=1) for line in lines if line and not line.startswith("#")]
    assert all(len(pair) == 2 for pair in pairs), pairs
    return dict(pairs)


def test_the_list_names_what_the_tests_need() -> None:
    assert set(entries()) >= {"redis-server", "bubblewrap", "util-linux", "python3", "openjdk-17-jre-headless",
                              "maven", "make", "chromium", "python3.11-venv", "docker-compose"}


def test_every_program_the_code_looks_up_is_on_the_list() -> None:
    sources = [*(ROOT / "rlbus").rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    lookup = r"""(?:shutil\.which|_require|require_program)\(\s*["']([\w.-]+)["']"""
    looked_up = {name for path in sources for name in re.findall(lookup, path.read_text())}
    assert {"redis-server", "bwrap", "java", "mvn"} <= looked_up  # the scan still finds them
    checks = " ".join(entries().values())
    assert {name for name in looked_up - NOT_PACKAGES if f"command -v {name}" not in checks} == set()


def test_make_test_and_ci_install_through_the_one_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_prerequisites = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    assert test_prerequisites is not None and "deps" in test_prerequisites.group(1).split()
    assert re.search(r"^deps:\n\t.*infra/install-deps\.sh", makefile, re.MULTILINE)
    assert re.search(r"^infra/install-deps\.sh$", ci, re.MULTILINE)
    for text in (makefile, ci):  # no second list
        assert "apt-get" not in text and "command -v" not in text


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False)


def test_missing_packages_are_named_with_the_command_that_installs_them(tmp_path: Path) -> None:
    listed = tmp_path / "packages.txt"
    listed.write_text("# comment\nmake  command -v make\nno-such-pkg   command -v no-such-program-here\n"
                      "no-such-pkg2  test -x /no/such/file\n")
    done = run_script("--check", str(listed))
    assert done.returncode == 1
    assert "missing: no-such-pkg no-such-pkg2" in done.stderr
    if shutil.which("apt-get"):
        assert "sudo apt-get install -y no-such-pkg no-such-pkg2" in done.stderr


def test_nothing_missing_installs_nothing(tmp_path: Path) -> None:
    listed = tmp_path / "packages.txt"
    listed.write_text("make  command -v make\n")
    done = run_script(str(listed))
    assert done.returncode == 0 and "all present" in done.stdout and "installing" not in done.stdout

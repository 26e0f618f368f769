"""`rlbus.registry`: built-ins by object or by lazy import path, a user's import paths, and errors that name the
config field, list what is registered and suggest the closest name. The engine registry checks a run config's
``[rollout] engine`` without importing torch or vLLM, and loading the vLLM kind does not import vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from rlbus.errors import ConfigError
from rlbus.registry import Registry, subclass_check

REPO = Path(__file__).resolve().parents[2]


#: What the registry below holds: widget classes are dicts (a base every process imports the same way).
Base = dict

MODULE = '''
class Good(dict):
    pass

class Other:
    pass

LOADED = True
'''


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"regplug_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def registry(points: list[EntryPoint] | None = None) -> Registry[type[dict[str, object]]]:
    return Registry("widget", group="test.widgets", field="w.kind", check=subclass_check(Base, "a widget class"),
                    entry_points=lambda group: [p for p in points or [] if p.group == group])


def test_built_ins_load_by_path_on_first_use_and_are_cached(module: str) -> None:
    widgets = registry()
    widgets.register("good", f"{module}:Good")
    assert widgets.names() == ["good"] and widgets.knows("good") and module not in sys.modules
    good = widgets.get("good")
    assert good.__name__ == "Good" and widgets.loaded == {"good": good} and widgets.get("good") is good
    widgets.register("good", f"{module}:Good")  # the same registration again is fine
    with pytest.raises(ValueError, match="already registered"):
        widgets.register("good", Base)


def test_import_paths_and_entry_points_resolve_and_every_failure_names_the_field(module: str) -> None:
    points = [EntryPoint(name="ep", value=f"{module}:Good", group="test.widgets"),
              EntryPoint(name="bad", value="no_such_pkg_xyz:W", group="test.widgets")]  # fmt: skip
    widgets = registry(points)
    widgets.register("base", Base)
    assert widgets.names() == ["bad", "base", "ep"] and widgets.knows(f"{module}:Other")
    assert widgets.get(f"{module}:Good").__name__ == "Good" and widgets.get("ep").__name__ == "Good"
    cases = [
        ("bsae", "w.kind", "unknown widget 'bsae'; did you mean `base`?; registered: bad, base, ep (a user's widget: "
                           "'package.module:Class', or an 'test.widgets' entry point)"),
        ("bad", "w.kind", "entry point 'bad' (no_such_pkg_xyz:W, group 'test.widgets') failed to load"),
        (f"{module}:Other", "w.kind", "is the class Other, not a widget class"),
        (f"{module}:LOADED", "w.kind", "is a bool, not a widget class"),
    ]
    for name, field, says in cases:
        with pytest.raises(ConfigError) as info:
            widgets.get(name)
        assert info.value.field == field and says in info.value.problem, info.value.problem
    with pytest.raises(ConfigError) as info:
        widgets.require("nope", field="--widget")
    assert info.value.field == "--widget"


def test_checking_an_engine_name_imports_neither_torch_nor_vllm() -> None:
    script = textwrap.dedent("""
        import json, sys
        from rlbus.launch.config import config_from_dict
        config_from_dict({"rollout": {"engine": "vllm"}}, {})
        checked = {"torch": "torch" in sys.modules, "vllm": "vllm" in sys.modules}
        from rlbus.engines.kinds import engine_kind
        kind = engine_kind("vllm")
        print(json.dumps({**checked, "kind": type(kind).__name__, "vllm_after_load": "vllm" in sys.modules}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"torch": False, "vllm": False, "kind": "VLLMKind", "vllm_after_load": False}

"""What a verdict rests on, attacked (rlbus/envs/swe/grading/attacks.py): one attack of each class on a library where
it beat the grader before these defences, graded on the unfixed repository (must score
0) and on top of the reference solution (must be caught, or change nothing); and the false-positive check on
a task of each library. ``rlbus bench swe`` runs every attack on every library, and every reference solution;
``test_grade.py`` runs every attack on calc-add."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.envs.swe.env import SHIPPED_CORPUS
from rlbus.envs.swe.grading.attacks import DESIGN_ATTACKS
from rlbus.envs.swe.grading.cheats import cheat_patches
from rlbus.envs.swe.grading.check import check_task
from rlbus.envs.swe.grading.grade import grade
from rlbus.envs.swe.task import RepoTask, load_tasks
from rlbus.envs.swe.world import template

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "swe" / "corpus"

#: class → (attack, task): each pair scored 1 on the unfixed repository with the grader of 68cc229.
REPRESENTATIVE = {
    "probe": ("probe_builtin_instance", "cachetools-cache-invert-condition-809665"),
    "controls": ("controls_knows_probes", "inflection-camelize-swap-arguments-6b30a6"),
    "oracle": ("oracle_test_source", "calc-add"),
    "channel": ("channel_dup2_capture", "more-itertools-matmul-swap-arguments-134cb8"),
    "startup": ("startup_platform_rewrite", "cachetools-cache-invert-condition-809665"),
    "test_files": ("test_files_rewrite", "inflection-camelize-swap-arguments-6b30a6"),
}
#: One task of each shipped library (the false-positive sample).
SAMPLE = (
    "cachetools-cache-setdefault-off-by-one-7968c4", "inflection-ordinal-change-constant-c49873",
    "more-itertools-peekable-bool-change-constant-c3040b", "parse-result-getitem-off-by-one-d429be",
    "tabulate-rst-escape-first-column-invert-condition-3e10c0", "toolz-compose-ne-invert-condition-21c177",
)  # fmt: skip


@pytest.fixture(scope="module")
def shipped() -> dict[str, RepoTask]:
    return {t.task_id: t for t in load_tasks([SHIPPED_CORPUS, FIXTURES])}


def test_every_class_is_represented() -> None:
    assert set(REPRESENTATIVE) == {a.kind for a in DESIGN_ATTACKS.values()}
    assert all(DESIGN_ATTACKS[name].kind == kind for kind, (name, _) in REPRESENTATIVE.items())


@pytest.mark.parametrize("kind", sorted(REPRESENTATIVE))
async def test_each_class_scores_zero_and_is_caught_or_inert_on_the_fix(
    shipped: dict[str, RepoTask], kind: str
) -> None:
    name, task_id = REPRESENTATIVE[kind]
    task = shipped[task_id]
    base = await template(task)
    [unfixed] = [c for c in cheat_patches(task, base) if c.name == name]
    [fixed] = [c for c in cheat_patches(task, base, on_fixed=True) if c.name == name]
    cheated = await grade(task, unfixed.patch)
    assert cheated.value == 0.0, cheated.reason
    riding = await grade(task, fixed.patch)
    assert riding.tampered or riding.value == 1.0, riding.reason  # caught, or it changed nothing
    if kind in ("controls",):  # the class's values meet answers the test process never holds: caught
        assert riding.value == 0.0 and "compares what the grader cannot read" in riding.reason


@pytest.mark.parametrize("task_id", SAMPLE)
async def test_reference_solutions_still_score_one_and_unchanged_repositories_zero(
    shipped: dict[str, RepoTask], task_id: str
) -> None:
    result = await check_task(shipped[task_id])
    assert result.ok, result.problem

"""Judges from config: rubric files, ``[reward] kind`` / ``[reward.judge]``, retries of unreadable scores,
the judge metrics and the reward worker's heartbeat figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus import metrics as m
from rlbus.errors import ConfigError
from rlbus.launch.arguments import judge_for, reward_args, trainer_args
from rlbus.launch.config import config_from_dict
from rlbus.rewards.judge import Judge, OpenAIJudge, Rubric, load_rubric
from rlbus.schemas import Prompt
from tests.unit.rewards.test_judge import episode

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "infra" / "rlbus" / "rubrics").glob("*.toml"))
PROMPT = Prompt(prompt_id="p1", env="arith", text="2+3=", reference="5")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_rubrics_load(path: Path) -> None:
    rubric = load_rubric(path)
    assert rubric.name == path.stem and rubric.dimensions and rubric.instructions


def test_a_rubric_scale_applies_to_dimensions_without_one(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text('scale = 5\n[[dimensions]]\nname = "a"\ncriterion = "c"\n[[dimensions]]\nname = "b"\n'
                    'criterion = "d"\nscale = 3\n')  # fmt: skip
    assert [d.scale for d in load_rubric(path).dimensions] == [5, 3]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('[[dimensions]]\nname = "a"\ncriterion = "c"\nweight = 0\n', "dimensions[0].weight"),
        ('[[dimensions]]\nname = "a"\ncriterion = "c"\n[[dimensions]]\nname = "b"\ncriterion = "c"\nscale = 0\n',
         "dimensions[1].scale"),
        ('[[dimensions]]\nname = "a"\ncriterion = ""\n', "dimensions[0].criterion"),
        ('[[dimensions]]\nname = "a b"\ncriterion = "c"\n', "dimensions[0].name"),
        ('[[dimensions]]\nname = "a"\ncriterion = "c"\nwieght = 2\n', "dimensions[0].wieght"),
        ('name = "x"\n[[dimensions]]\nname = "a"\ncriterion = "c"\n[[dimensions]]\nname = "a"\ncriterion = "d"\n',
         ""),
    ],
)
def test_rubric_errors_name_the_file_and_field(tmp_path: Path, body: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as caught:
        load_rubric(path)
    assert caught.value.field.startswith(str(path))
    assert caught.value.field.endswith(field)


def test_unreadable_and_invalid_toml_rubrics_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_rubric(tmp_path / "missing.toml")
    (tmp_path / "x.toml").write_text("dimensions = [")
    with pytest.raises(ConfigError, match="not valid TOML") as caught:
        load_rubric(tmp_path / "x.toml")
    assert caught.value.field == str(tmp_path / "x.toml")


class Flaky:
    """Replies from a queue; records the temperature of each call."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.temperatures: list[float | None] = []

    async def complete(self, system: str, user: str, *, temperature: float | None = None) -> str:
        self.temperatures.append(temperature)
        return self.replies.pop(0)


def one_dimension() -> Rubric:
    return Rubric.from_dict({"dimensions": [{"name": "correct", "criterion": "right?"}]})


def sample(name: str, source: str) -> float:
    return m.REGISTRY.get_sample_value(name, {"source": source}) or 0.0


async def test_an_unreadable_score_is_retried_at_the_retry_temperature() -> None:
    backend = Flaky(["no idea", "SCORE: 14/10", "Fine.\nSCORE: 7/10"])
    retries_before = sample("rlbus_judge_retries_total", "judge-retry")
    judge = Judge(one_dimension(), backend, source="judge-retry", parse_retries=2, retry_temperature=0.9)
    reward = await judge.score(episode(), PROMPT)
    assert reward.value == pytest.approx(0.7) and reward.metadata["judge_valid"] == "true"
    assert backend.temperatures == [None, 0.9, 0.9]
    assert reward.metadata["judge_retries"] == "2" and "after 3 tries" in reward.reason
    assert sample("rlbus_judge_retries_total", "judge-retry") == retries_before + 2
    assert judge.stats.as_dict()["judge_retries"] == 2 and judge.stats.invalid == 0


async def test_retries_are_bounded_then_the_judgement_is_published_invalid() -> None:
    backend = Flaky(["?", "SCORE: 11/10", "SCORE: 3/4", "never read"])
    invalid_before = sample("rlbus_judge_invalid_total", "judge-bounded")
    judge = Judge(one_dimension(), backend, source="judge-bounded", parse_retries=2)
    reward = await judge.score(episode(), PROMPT)
    assert backend.replies == ["never read"]  # 1 + 2 calls, no more
    assert reward.metadata["judge_valid"] == "false" and reward.metadata["judge_invalid"] == "correct"
    assert reward.value == 0.0 and reward.components == {}
    assert "not out of 10" in reward.reason
    assert sample("rlbus_judge_invalid_total", "judge-bounded") == invalid_before + 1
    assert m.REGISTRY.get_sample_value("rlbus_judge_seconds_count", {"source": "judge-bounded"}) == 1
    assert judge.stats.as_dict()["judge_invalid_rate"] == 1.0


def run_config(tmp_path: Path, **judge: object) -> dict[str, object]:
    rubric = ROOT / "infra" / "rlbus" / "rubrics" / "answer.toml"
    return {"reward": {"kind": "both", "judge": {"rubric": str(rubric), **judge}},
            "trainer": {"reward_sources": ["verifier", "judge"], "reward_weights": {"judge": 0.5},
                        "invalid_judgements": "downweight", "invalid_weight": 0.25}}  # fmt: skip


async def test_an_openai_judge_from_config_with_the_key_from_a_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    raw = run_config(tmp_path, backend="openai", base_url="http://127.0.0.1:9/v1", model="judge-m",
                     api_key_file=str(key), parse_retries=1, timeout_s=3.0, retries=7, max_tokens=4)  # fmt: skip
    config = config_from_dict(raw, {})
    judge = judge_for(config)
    assert judge is not None and isinstance(judge.backend, OpenAIJudge)
    assert judge.backend.api_key == "sk-test" and judge.backend.model == "judge-m" and judge.parse_retries == 1
    assert judge.backend.url == "http://127.0.0.1:9/v1/chat/completions" and judge.backend.retries == 7
    assert judge.backend.timeout.total == 3.0 and judge.backend.max_tokens == 4
    assert judge.rubric.name == "answer"
    await judge.close()
    args = trainer_args(config)
    assert args["reward_weights"] == {"judge": 0.5} and args["invalid_judgements"] == "downweight"
    assert args["invalid_weight"] == 0.25


async def test_the_key_may_come_from_the_environment(tmp_path: Path) -> None:
    raw = run_config(tmp_path, backend="openai", base_url="http://127.0.0.1:9", model="m", api_key_env="MY_KEY")
    judge = judge_for(config_from_dict(raw, {}), environ={"MY_KEY": "from-env"})
    assert judge is not None and isinstance(judge.backend, OpenAIJudge) and judge.backend.api_key == "from-env"
    await judge.close()


def test_a_verifier_run_builds_no_judge() -> None:
    assert [type(s).__name__ for s in reward_args(config_from_dict({}, {}))["scorers"]] == ["VerifierScorer"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"reward": {"kind": "judge"}}, "reward.judge.rubric"),
        ({"reward": {"kind": "critic"}}, "reward.kind"),
        ({"reward": {"kind": "judge", "judge": {"rubric": "r.toml", "backend": "openai"}}}, "reward.judge"),
        ({"reward": {"kind": "judge", "judge": {"rubric": "r.toml", "parse_retries": -1}}}, "reward.judge"),
        ({"reward": {"judge": {"rubric": "r.toml", "source": "verifier"}}}, "reward.judge"),
        ({"reward": {"judge": {"rubric": "r.toml", "timeout": 3}}}, "reward.judge.timeout"),
        ({"trainer": {"reward_weights": {"judge": 1.0}}}, "trainer"),
        ({"trainer": {"invalid_judgements": "ignore"}}, "trainer.invalid_judgements"),
        ({"trainer": {"invalid_weight": 2.0}}, "trainer"),
    ],
)
def test_judge_config_errors_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(raw, {})
    assert caught.value.field.startswith(field)


def test_a_missing_rubric_file_fails_the_reward_role_at_start(tmp_path: Path) -> None:
    config = config_from_dict({"reward": {"kind": "judge", "judge": {"rubric": str(tmp_path / "no.toml")}}}, {})
    with pytest.raises(ConfigError, match="cannot read the rubric"):
        judge_for(config)

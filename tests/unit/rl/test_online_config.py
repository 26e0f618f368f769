"""``[trainer.online]`` in the run config: defaults off, every bad value fails at start naming its field,
and the table reaches the trainer stack's arguments."""

from __future__ import annotations

from typing import Any

import pytest

from rlbus.errors import ConfigError
from rlbus.launch.arguments import trainer_args
from rlbus.launch.config import config_from_dict, to_tables


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"ema": 0.0}, "trainer.online.ema"),
        ({"ema": 1.5}, "trainer.online.ema"),
        ({"estimator": "grpo"}, "trainer.online.estimator"),
        ({"baseline": "user"}, "trainer.online.baseline"),
        ({"window": 0}, "trainer.online.window"),
        ({"max_age_s": 0}, "trainer.online.max_age_s"),
        ({"max_staleness": -1}, "trainer.online.max_staleness"),
        ({"release_every_rewards": 0}, "trainer.online.release_every_rewards"),
        ({"release_every_s": -5}, "trainer.online.release_every_s"),
        ({"sources": []}, "trainer.online.sources"),
        ({"releases": 3}, "trainer.online.releases"),
    ],
)
def test_a_bad_online_table_names_the_field(table: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"trainer": {"online": table}}, {})
    assert info.value.field == field


def test_the_online_table_reaches_the_trainer_stack() -> None:
    config = config_from_dict({}, {})
    assert not config.trainer.online.enabled
    config = config_from_dict({"trainer": {"online": {"enabled": True, "estimator": "loo", "window": 16,
                                                      "release_every_rewards": 8, "release_every_s": 60}}}, {})
    online = trainer_args(config)["online"]
    assert (online.enabled, online.estimator, online.window, online.release_every_rewards) == (True, "loo", 16, 8)
    assert config_from_dict(to_tables(config), {}) == config  # the TOML round trip keeps it

"""The embedded demo's whole loop, cut down to seconds: every role runs, versions flow as deltas, and every
trained rollout is accounted for exactly once."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rlbus.demo import Demo, DemoConfig, DemoResult
from rlbus.demo_view import plot, summary_table


async def test_demo_runs_every_role_end_to_end(tmp_path: Path) -> None:
    config = dataclasses.replace(
        DemoConfig.quick().tuned(trainer={"warm_steps": 10, "groups_per_step": 2}, task={"group_size": 4}),
        workers=2, rl_steps=3,
        time_budget_s=120, eval_size=10,
    )
    demo = Demo(config, tmp_path)
    result: DemoResult = await demo.run()
    assert result.steps == 3 and result.versions_published == 4  # v1 = the warm start, then one per step
    assert all(s.version is not None and s.version >= 2 for s in demo.syncs)
    assert all(s.digest == demo.syncs[0].digest for s in demo.syncs if s.version == demo.syncs[0].version)
    assert result.rollouts_trained >= 3 * 2 * 4
    assert result.outcomes["duplicate"] == 0 and result.outcomes["dead_lettered"] == 0
    assert 0 < result.delta_bytes_mean < result.full_bytes
    # Measured, and loose: the figure is a benchmark's (well under 1 ms p99 in RESULTS); a busy CI core is not.
    assert 0 < result.swap_pause_ms_p99 < 500
    assert 0.0 <= result.accuracy_start <= 1.0 and 0.0 <= result.accuracy_end <= 1.0
    assert plot(result, tmp_path / "demo.png").stat().st_size > 10_000
    assert summary_table(result).row_count >= 5
    from rlbus.observe.report import write_report
    from rlbus.observe.runlog import read

    assert [e["step"] for e in read(tmp_path, "steps")] == [1, 2, 3]
    assert len(list(read(tmp_path, "weights"))) == 4 and (tmp_path / "summary.json").exists()
    write_report(tmp_path, tmp_path / "report")
    assert (tmp_path / "report" / "report.md").exists()


def test_sloppy_teacher_is_off_by_one_on_the_given_share() -> None:
    from rlbus.envs.tasks import generate_prompts
    from rlbus.training.warm import sloppy_teacher

    prompts = generate_prompts("arith", seed=3, n=400, config={"digits": 1})
    taught = sloppy_teacher(prompts, 0.55, seed=0)
    wrong = [t for p, t in zip(prompts, taught, strict=True) if p.reference != t.reference]
    assert 0.45 < len(wrong) / len(prompts) < 0.65
    assert all(int(t.reference or "") == int(p.reference or "") + 1 for p, t in zip(prompts, taught, strict=True)
               if p.reference != t.reference)
    assert sloppy_teacher(prompts, 0.0, seed=0) == prompts


async def test_sync_mode_trains_only_current_version_rollouts(tmp_path: Path) -> None:
    """The baseline of `rlbus bench pipeline`: one batch per version, nothing stale, snapshots kept."""
    config = dataclasses.replace(
        DemoConfig.quick().tuned(trainer={"warm_steps": 10, "groups_per_step": 2}, task={"group_size": 4}),
        workers=2, rl_steps=3,
        time_budget_s=120, eval_size=10, mode="sync", snapshot_every=1,
    )
    demo = Demo(config, tmp_path)
    result = await demo.run()
    assert result.steps == 3 and set(result.staleness) == {0}
    assert result.rollouts_dropped == 0 and result.outcomes["duplicate"] == 0
    assert [step for _, step, _ in demo.snapshots] == [1, 2, 3]
    assert demo.rl_wall_s > 0 and all(w.active_s > 0 for w in demo.rollout_workers)


async def test_demo_trains_an_hf_model_through_every_role(tmp_path: Path, tiny_hf_dir: Path) -> None:
    """`rlbus demo --model DIR`: an HF model directory (random Llama + ChatML tokenizer) in every role — warm
    start through its chat template, rollout engines, trainer, weight sync (tied embedding shipped once)."""
    env_config = {"digits": 2, "instructions": True, "max_new_tokens": 8, "context_tokens": 256,
                  "max_total_tokens": 256}
    config = dataclasses.replace(
        DemoConfig.for_model(str(tiny_hf_dir)).tuned(
            trainer={"warm_steps": 2, "groups_per_step": 2}, task={"group_size": 2, "env_config": env_config}
        ),
        workers=1, rl_steps=2, time_budget_s=120, eval_size=4,
    )
    demo = Demo(config, tmp_path)
    assert demo.source.kind == "hf" and demo.source.directory == tiny_hf_dir
    result = await demo.run()
    assert result.steps == 2 and result.versions_published == 3
    import torch

    from rlbus.models.base import weight_tensors

    assert demo.trainer is not None and demo.syncs[0].version == 3
    served, master = demo.syncs[0].state, weight_tensors(demo.trainer.model)
    assert "model.embed_tokens.weight" in served and "lm_head.weight" not in served  # tied: shipped once
    assert served.keys() == master.keys()
    assert all(torch.equal(served[k], master[k].to(torch.bfloat16)) for k in master)  # bit-exact after deltas
    # a random model never answers, so every advantage is 0 and the RL deltas are empty; the warm start's
    # change arrived as the v1 keyframe
    assert result.rollouts_trained >= 2 * 2 * 2 and result.outcomes["dead_lettered"] == 0


async def test_a_demo_that_runs_out_of_time_says_what_it_was_waiting_for(tmp_path: Path) -> None:
    config = dataclasses.replace(
        DemoConfig.quick().tuned(trainer={"warm_steps": 10, "groups_per_step": 2}, task={"group_size": 4}),
        workers=1, rl_steps=10_000, time_budget_s=3, eval_size=4,
    )
    result = await Demo(config, tmp_path).run()
    assert not result.completed and result.steps < 10_000
    assert result.stalled is not None
    done = re.search(r"(\d+) of 10000 steps", result.stalled)  # the trainer may finish one more step after it
    assert done is not None and int(done.group(1)) <= result.steps
    assert "prompts admitted" in result.stalled and "trainer v" in result.stalled
    assert result.figures()["completed"] is False


def test_the_cli_exits_1_when_the_demo_ends_on_its_time_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from rlbus.cli.app import app

    async def ran_out(self: Demo) -> DemoResult:
        return DemoResult(accuracy_start=0.3, accuracy_end=0.3, versions_published=4, rollouts_trained=24,
                          rollouts_dropped=24, max_staleness=2, delta_bytes_mean=1.0, full_bytes=10, wall_s=300.0,
                          swap_pause_ms_p99=0.1, steps=3, steps_target=60,
                          stalled="3 of 60 steps, the last 290 s ago; trainer v4, workers eu-west v1")

    monkeypatch.setattr(Demo, "run", ran_out)
    monkeypatch.setattr("rlbus.demo_view.plot", lambda result, path: path)
    out = CliRunner().invoke(app, ["demo", "--run-dir", str(tmp_path), "--json", str(tmp_path / "f.json")])
    assert out.exit_code == 1, out.output
    text = " ".join(out.output.split())  # the console wraps at its width
    assert "did not do its job" in text and "3 of 60 RL steps" in text and "workers eu-west v1" in text


#: The shape of the quick tests' demo (`DemoConfig.quick().tuned(...)`) as a user's run config, naming a Kafka
#: cluster, Redis and a blob server the embedded demo must not reach.
RUN_TOML = """
[bus]
bootstrap = "kafka.invalid:9092"
[state]
url = "redis://redis.invalid:6379/0"
[store]
url = "http://blobs.invalid:8470"
[task]
group_size = 4
[trainer]
warm_steps = 10
groups_per_step = 2
teacher_error = 0.55
"""


def test_demo_config_runs_a_users_run_config_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlbus demo --config`: the file's run on the in-memory bus and state store, blobs in the run directory —
    the [bus], [state] and [store] it names (hosts that do not resolve) are never reached."""
    from typer.testing import CliRunner

    from rlbus.cli.app import app

    for name in ("RLBUS_KAFKA_BOOTSTRAP", "RLBUS_REDIS_URL", "RLBUS_BLOB_URL"):  # CI's services would override
        monkeypatch.delenv(name, raising=False)  # the file's hosts (the environment wins over a config file)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    run_dir = tmp_path / "demo"
    out = CliRunner().invoke(app, ["demo", "--config", str(tmp_path / "run.toml"), "--steps", "2", "--workers",
                                       "1", "--time-budget", "60", "--run-dir", str(run_dir),
                                       "--json", str(tmp_path / "f.json")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "embedded: in-memory bus and state store" in text and "redis://redis.invalid:6379/0" in text
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["completed"] is True and summary["accuracy_base"] is not None
    assert (run_dir / "blobs").is_dir()


def test_demo_config_rejects_model_and_quick_and_names_a_bad_field(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rlbus.cli.app import app

    (tmp_path / "run.toml").write_text(RUN_TOML)
    for extra in (["--quick"], ["--model", "smollm2-135m-instruct"]):
        out = CliRunner().invoke(app, ["demo", "--config", str(tmp_path / "run.toml"), *extra])
        assert out.exit_code == 2 and "does not combine" in " ".join(out.output.split()), out.output
    (tmp_path / "bad.toml").write_text("[trainer]\ngroups_per_stp = 2\n")
    out = CliRunner().invoke(app, ["demo", "--config", str(tmp_path / "bad.toml")])
    assert out.exit_code == 1 and "groups_per_stp" in out.output and "groups_per_step" in out.output, out.output
    # a prompt the demo's 64-byte policy cannot hold fails at once, not after the time budget with 0 steps
    (tmp_path / "long.jsonl").write_text('{"env": "answer", "text": "Ann has 3 boxes of 12 eggs. How many eggs?", '
                                         '"reference": "36"}\n')
    (tmp_path / "long.toml").write_text(f'[task]\nprompts = "{tmp_path / "long.jsonl"}"\n')
    out = CliRunner().invoke(app, ["demo", "--config", str(tmp_path / "long.toml")])
    said = " ".join(out.output.split())
    assert out.exit_code == 1 and "model.max_seq" in said and "line 1)" in said, out.output


async def test_demo_config_with_a_prompt_file_and_no_warm_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """``[trainer] warm_steps = 0`` starts RL from the initial weights; ``[task] prompts`` trains on the file
    while the evaluation draws from ``[task] env``; the join in prompt order (a run config's default) works."""
    from rlbus.launch.config import load_config
    from rlbus.wiring import producer

    lines = [f'{{"env": "arith", "text": "{a}+{b}=", "reference": "{a + b}", "prompt_id": "mine-{a}{b}"}}'
             for a, b in ((1, 2), (3, 4), (5, 2))]
    (tmp_path / "mine.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.toml").write_text(
        f'[task]\ngroup_size = 4\nprompts = "{tmp_path / "mine.jsonl"}"\n'
        '[trainer]\nwarm_steps = 0\ngroups_per_step = 2\n[state]\nurl = "redis://redis.invalid:6379/0"\n')
    published: list[str] = []
    file_prompts = producer.file_prompts

    def recorded(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for prompt in file_prompts(*args, **kwargs):  # type: ignore[arg-type]
            published.append(prompt.prompt_id)
            yield prompt

    monkeypatch.setattr(producer, "file_prompts", recorded)
    run = load_config(tmp_path / "run.toml")
    config = dataclasses.replace(DemoConfig.from_run(run), workers=1, rl_steps=2, time_budget_s=60, eval_size=4)
    assert config.run.state.url == "memory://" and config.run.trainer.ordered
    demo = Demo(config, tmp_path / "demo")
    assert [p.env for p in demo.eval_prompts()] == ["arith"] * 4 and all(
        not p.prompt_id.startswith("mine-") for p in demo.eval_prompts())
    result = await demo.run()
    assert result.steps == 2 and result.accuracy_base is None  # no warm start: nothing before it to measure
    assert published and all(pid.startswith("mine-") for pid in published)


async def test_demo_config_with_a_checkpoint_starts_rl_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """``[model] checkpoint``: RL starts from the checkpoint's weights, as the trainer role does (no warm start
    on top of them, though ``warm_steps`` is set)."""
    from rlbus import demo as demo_module
    from rlbus.launch.config import load_config
    from rlbus.training.checkpoint import TrainerState, save_checkpoint

    base = Demo(DemoConfig(), tmp_path / "base").source.build(seed=7)
    save_checkpoint(tmp_path / "ckpt", TrainerState(step=0, version=0, model=base.state_dict(),
                                                    model_description=base.describe()))
    (tmp_path / "run.toml").write_text(f'[model]\ncheckpoint = "{tmp_path / "ckpt"}"\n[task]\ngroup_size = 4\n'
                                       '[trainer]\nwarm_steps = 10\ngroups_per_step = 2\n')
    loaded: list[object] = []
    initial_model = demo_module.initial_model
    monkeypatch.setattr(demo_module, "initial_model", lambda run: loaded.append(initial_model(run)) or loaded[-1])
    monkeypatch.setattr(Demo, "warm_start", lambda self, model: pytest.fail("warm start on a checkpoint"))
    config = dataclasses.replace(DemoConfig.from_run(load_config(tmp_path / "run.toml")), workers=1, rl_steps=1,
                                 time_budget_s=60, eval_size=4)
    demo = Demo(config, tmp_path / "demo")
    result = await demo.run()
    assert result.steps == 1 and result.accuracy_base is None
    assert demo.trainer is not None and loaded == [demo.trainer.model]


def test_without_a_terminal_a_stall_is_one_line_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from rich.console import Console

    from rlbus.demo_view import status_logger

    printed: list[str] = []
    clock = [0.0]
    console = Console()
    monkeypatch.setattr(console, "print", lambda line, **_: printed.append(line))
    monkeypatch.setattr("rlbus.demo_view.status_line", lambda demo: demo.line)
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    log = status_logger(console)
    demo = SimpleNamespace(phase="async RL", line="step 3 v4")
    for t in range(200):  # the view updates 4 times a second; one tick a second is enough here
        clock[0] = float(t)
        demo.line = "step 3 v4" if t < 150 else "step 4 v5"
        log(demo)
    assert printed == ["step 3 v4", "step 3 v4  (no change for 60 s)", "step 3 v4  (no change for 120 s)",
                       "step 4 v5"]


def test_eval_prompts_is_the_held_out_file_the_demo_evaluates_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """``[task] eval_prompts``: the user's own held-out file replaces ``[task] env``'s generator in the demo's
    before/after accuracy (its first ``eval_size`` lines), scored by the run's reward function when it has one
    (as RL is); a missing file fails when the config loads."""
    from rlbus.errors import ConfigError
    from rlbus.launch.config import load_config

    held = [f'{{"env": "answer", "text": "{a} + {a}?", "reference": "{2 * a}", "prompt_id": "held-{a}"}}'
            for a in range(1, 6)]
    (tmp_path / "held.jsonl").write_text("\n".join(held) + "\n")
    (tmp_path / "train.jsonl").write_text('{"env": "answer", "text": "1 + 2?", "reference": "3"}\n')
    (tmp_path / "run.toml").write_text(f'[task]\nprompts = "{tmp_path / "train.jsonl"}"\n'
                                       f'eval_prompts = "{tmp_path / "held.jsonl"}"\n')
    run = load_config(tmp_path / "run.toml")
    demo = Demo(dataclasses.replace(DemoConfig.from_run(run), eval_size=3), tmp_path / "demo")
    assert [p.prompt_id for p in demo.eval_prompts()] == ["held-1", "held-2", "held-3"]
    assert demo.scorer is None  # each prompt's environment scores
    (tmp_path / "lastnumber.py").write_text("def score(prompt, completion, reference):\n"
                                            "    return float(completion.split()[-1] == reference)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "run.toml").write_text(f'[task]\neval_prompts = "{tmp_path / "held.jsonl"}"\n'
                                       '[reward]\nfunction = "lastnumber:score"\n')
    demo = Demo(DemoConfig.from_run(load_config(tmp_path / "run.toml")), tmp_path / "demo")
    assert demo.scorer is not None and demo.scorer.path == "lastnumber:score"
    (tmp_path / "run.toml").write_text('[task]\neval_prompts = "nowhere.jsonl"\n')
    with pytest.raises(ConfigError, match=r"eval_prompts file 'nowhere\.jsonl' does not exist"):
        load_config(tmp_path / "run.toml")

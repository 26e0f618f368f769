"""Offline DPO: sequence log-probs are sums (or means) over the trained tokens, the reference is the
starting policy (loss log 2 at step 0), a few dozen steps teach a tiny policy a held-out preference, the
loaders read every supported JSONL form, splits keep a prompt on one side, and an HF model trains too."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from rlbus.training.dpo import (
    DPOConfig,
    load_preference_data,
    reference_logprobs,
    sequence_logprobs,
    split_pairs,
    train_dpo,
)
from rlbus.training.preference import PreferencePair, write_pairs
from rlbus.training.sft import SFTExample

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)
TOK = ByteTokenizer()


def model(seed: int = 0, cfg: PolicyConfig = CFG) -> Policy:
    torch.manual_seed(seed)
    return Policy(cfg)


def pair(prompt: str, chosen: str = "yes", rejected: str = "no", prompt_id: str = "") -> PreferencePair:
    context = TOK.encode(prompt, bos=True)
    return PreferencePair(
        chosen=SFTExample.from_completion(context, TOK.encode(chosen, eos=True)),
        rejected=SFTExample.from_completion(context, TOK.encode(rejected, eos=True)),
        prompt_id=prompt_id,
    )


def synthetic(n: int, offset: int = 0) -> list[PreferencePair]:
    """Varied prompts; the chosen answer is always "yes", the rejected one always "no"."""
    return [pair(f"q{(offset + i) * 7 % 100:02d}?") for i in range(n)]


def full_logit_logprob(m: Policy, e: SFTExample) -> tuple[float, int]:
    """Σ log π over the trained tokens from the model's full logits, and how many there are."""
    ids = torch.tensor(e.token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(m(ids[None, :-1]).logits[0].float(), -1)  # [T-1, V]
    picked = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if e.trained[t]]
    return sum(picked), len(picked)


def test_sequence_logprobs_sum_or_average_the_trained_tokens() -> None:
    m = model()
    sides = [pair("ab").chosen, pair("long prompt", rejected="nope nope").rejected]
    expected = [full_logit_logprob(m, s) for s in sides]
    with torch.no_grad():
        summed = sequence_logprobs(m, sides)
        mean = sequence_logprobs(m, sides, length_normalize=True, chunk=3)
    assert summed.shape == (2,)
    for i, (total, n) in enumerate(expected):
        assert float(summed[i]) == pytest.approx(total, abs=1e-4)
        assert float(mean[i]) == pytest.approx(total / n, abs=1e-5)
    assert [n for _, n in expected] == [4, 10]  # "yes" + EOS, "nope nope" + EOS: the prompt is never scored


def test_reference_is_the_starting_policy_so_the_first_loss_is_log_2() -> None:
    m, pairs = model(), synthetic(6)
    ref_chosen, ref_rejected = reference_logprobs(m, pairs, DPOConfig(batch_size=4))
    with torch.no_grad():
        assert torch.allclose(ref_chosen, sequence_logprobs(m, [p.chosen for p in pairs]), atol=1e-5)
        assert torch.allclose(ref_rejected, sequence_logprobs(m, [p.rejected for p in pairs]), atol=1e-5)
    for kind in ("sigmoid", "ipo"):
        result = train_dpo(model(), pairs, DPOConfig(steps=1, batch_size=6, lr=1e-3, loss=kind))  # type: ignore[arg-type]
        first = result.steps[0]
        expected = math.log(2) if kind == "sigmoid" else (1 / (2 * 0.1)) ** 2  # h = 0
        assert first.loss == pytest.approx(expected, abs=1e-4)
        assert first.margin == pytest.approx(0.0, abs=1e-4) and first.accuracy == 0.0
        assert first.grad_norm > 0 and first.tokens_per_s > 0


def test_dpo_teaches_a_held_out_preference() -> None:
    train, held_out = synthetic(24), synthetic(8, offset=50)
    m = model(cfg=PolicyConfig.tiny())
    config = DPOConfig(beta=0.1, lr=1e-3, batch_size=8, steps=30, eval_every=10, seed=0)
    result = train_dpo(m, train, config, eval_pairs=held_out)
    assert [e.step for e in result.evals] == [0, 10, 20, 30]
    start, end = result.evals[0], result.evals[-1]
    assert start.margin == pytest.approx(0.0, abs=1e-4) and start.loss == pytest.approx(math.log(2), abs=1e-4)
    assert end.accuracy > 0.9
    assert end.margin > 0.5 and end.loss < 0.5 * start.loss
    assert [e.margin for e in result.evals] == sorted(e.margin for e in result.evals)
    assert result.steps[-1].margin > result.steps[0].margin
    assert result.steps[-1].chosen_reward > result.steps[-1].rejected_reward


def test_training_is_seeded_and_bf16_autocast_runs() -> None:
    pairs = synthetic(8)
    a = train_dpo(model(), pairs, DPOConfig(steps=3, batch_size=3, lr=1e-3, seed=1))
    b = train_dpo(model(), pairs, DPOConfig(steps=3, batch_size=3, lr=1e-3, seed=1))
    assert [s.loss for s in a.steps] == [s.loss for s in b.steps]
    bf16 = train_dpo(model(), pairs, DPOConfig(steps=2, batch_size=4, lr=1e-3, compute_dtype="bfloat16"))
    assert all(math.isfinite(s.loss) for s in bf16.steps)


def test_one_step_on_a_tiny_hf_llama() -> None:
    transformers = pytest.importorskip("transformers")
    from rlbus.models.hf import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = HFCausalLM.from_config(config, seed=0)
    before = [p.detach().clone() for p in m.parameters()]
    result = train_dpo(m, synthetic(4), DPOConfig(steps=1, batch_size=4, lr=1e-3), eval_pairs=synthetic(2, 9))
    assert result.steps[0].loss == pytest.approx(math.log(2), abs=1e-4)
    assert result.evals[0].margin == pytest.approx(0.0, abs=1e-4)
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))


# ----------------------------------------------------------------------------------------------------------
# data


class FakeChat:
    """BOS, then per message: a role byte (context), its content bytes and "\\n" (trained for the assistant)."""

    def render_messages(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
        ids, mask = [BOS_ID], [False]
        for message in messages:
            body = [*TOK.encode(str(message["content"])), 10]
            ids += [ord(str(message["role"])[0].upper()), *body]
            mask += [False] + [message["role"] == "assistant"] * len(body)
        return ids, mask


def write_rows(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_text(e: SFTExample) -> str:
    return TOK.decode([i for i, t in zip(e.token_ids, e.trained, strict=True) if t])


def test_token_rows_round_trip(tmp_path: Path) -> None:
    pairs = [pair("a", prompt_id="p0"), pair("b", "sure", "never")]
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    assert load_preference_data(tmp_path / "pairs.jsonl") == pairs


def test_text_rows_use_the_byte_tokenizer_without_a_chat_format(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "text.jsonl", [{"prompt": "3+4=", "chosen": "7", "rejected": "8", "prompt_id": "x",
                                                 "chosen_reward": 1.0, "rejected_reward": 0.0}])
    (got,) = load_preference_data(path)
    assert got.chosen.token_ids == (BOS_ID, *b"3+4=", ord("7"), EOS_ID)
    assert got.chosen.trained == (False,) * 5 + (True, True)
    assert got.rejected.token_ids[-2] == ord("8")
    assert (got.prompt_id, got.margin) == ("x", 1.0)


def test_chat_rows_train_only_the_response(tmp_path: Path) -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "2+2?"}]
    rows = [
        {"prompt": history, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}]},
        {"chosen": [*history, {"role": "assistant", "content": "4"}],
         "rejected": [*history, {"role": "assistant", "content": "5"}]},
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    ]
    explicit, implicit, text = load_preference_data(write_rows(tmp_path / "chat.jsonl", rows), FakeChat())
    assert explicit == implicit
    assert trained_text(explicit.chosen) == "4\n" and trained_text(explicit.rejected) == "5\n"  # not "hello\n"
    assert explicit.chosen.token_ids[: -3] == explicit.rejected.token_ids[: -3]
    assert text.chosen.token_ids == (BOS_ID, ord("U"), *b"2+2?\n", ord("A"), *b"4\n")
    assert trained_text(text.rejected) == "5\n"


@pytest.mark.parametrize(
    ("row", "chat", "message"),
    [
        ({"chosen": "a"}, None, "expected chosen_ids"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}, None, "chat format"),
        ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]}, FakeChat(),
         "shared prompt"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, FakeChat(), "trained token"),
        ({"prompt": "q", "chosen": [1, 2], "rejected": "b"}, FakeChat(), "list of messages"),
        ({"chosen_ids": [1, 2], "chosen_mask": [0, 1], "rejected_ids": [1]}, None, "rejected_mask"),
    ],
)
def test_bad_rows_name_the_line(tmp_path: Path, row: dict[str, Any], chat: FakeChat | None, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(pair("ok").to_json()) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        load_preference_data(path, chat)


def test_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("{nope\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_preference_data(path)


def test_split_is_seeded_and_keeps_a_prompt_on_one_side() -> None:
    pairs = [pair(f"p{i // 2}", chosen=f"c{i}", prompt_id=f"p{i // 2}") for i in range(20)]
    train, held = split_pairs(pairs, 0.2, seed=3)
    assert (len(train), len(held)) == (16, 4)
    assert {p.prompt_id for p in train}.isdisjoint({p.prompt_id for p in held})
    assert split_pairs(pairs, 0.2, seed=3) == (train, held)
    assert split_pairs(pairs, 0.0) == (pairs, [])
    with pytest.raises(ValueError):
        split_pairs(pairs, 1.0)

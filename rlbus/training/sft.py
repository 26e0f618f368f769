"""Supervised warm start: cross-entropy on reference completions, so RL starts from a model that is
sometimes right.

GRPO learns only from groups whose rewards differ. A randomly initialised policy essentially never answers
correctly, every group scores the same, every advantage is 0 and RL has no gradient. A short supervised
phase on (prompt, reference completion) pairs fixes that. For examples j with prompt p_j and completion
c_j = (c_1 … c_n_j):

    L = (1 / Σ_j n_j) · Σ_j Σ_i −log π(c_i | p_j, c_<i)        (+ the MoE balancing loss)

a token-level mean over completion tokens only: the prompt is context, not something to imitate.
Batches are drawn without replacement from a seeded permutation (a fresh one each epoch); AdamW with
gradient-norm clipping at 1. Sequences are packed exactly like RL rollouts (`rlbus.training.batch.pack`),
with the completion as the loss mask.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.rl.logprobs import sampled_token_logprobs
from rlbus.training.batch import Sample, pack
from rlbus.training.checkpoint import (
    TrainerState,
    load_checkpoint,
    policy_config_dict,
    policy_from_state,
    save_checkpoint,
)


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the completion the model should produce after it (token ids)."""

    prompt_ids: tuple[int, ...]
    """At least one token (something must predict the first completion token)."""
    completion_ids: tuple[int, ...]
    """At least one token; usually ends with EOS so the model learns to stop."""

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError("an SFT example needs a non-empty prompt and a non-empty completion")


def _sample(example: SFTExample) -> Sample:
    P, C = len(example.prompt_ids), len(example.completion_ids)
    return Sample(
        token_ids=torch.tensor(example.prompt_ids + example.completion_ids, dtype=torch.long),
        loss_mask=torch.cat([torch.zeros(P, dtype=torch.bool), torch.ones(C, dtype=torch.bool)]),
        logprobs=torch.zeros(P + C),
        versions=torch.full((P + C,), -1, dtype=torch.long),
    )


def pretrain(
    model: Policy,
    examples: Sequence[SFTExample],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    *,
    weight_decay: float = 0.0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps; returns the cross-entropy of every step.

    ``on_step(step, loss)`` is called after each step (progress output). The batch order depends only on
    ``seed``, so two runs from the same weights give the same losses.
    """
    if not examples:
        raise ValueError("pretrain needs at least one example")
    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError("need steps >= 0, batch_size >= 1 and lr > 0")
    samples = [_sample(e) for e in examples]
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    order: list[int] = []
    losses: list[float] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(samples), generator=generator).tolist()
        picked, order = order[:batch_size], order[batch_size:]
        batch = pack([samples[i] for i in picked], torch.zeros(len(picked))).to(device)
        out = model(batch.inputs, key_mask=batch.key_mask)
        logp = sampled_token_logprobs(out.logits, batch.targets)  # [B, S]
        ce = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
        loss = ce if out.aux_loss is None else ce + out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(ce.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def load_examples(path: Path, tokenizer: ByteTokenizer | None = None) -> list[SFTExample]:
    """Examples from a JSONL file, one object per line, either as text or as token ids:

    ``{"prompt": "3+4=", "completion": "7"}`` — byte-tokenized: BOS + prompt, completion + EOS;
    ``{"prompt_ids": [...], "completion_ids": [...]}`` — taken as is (any chat format, any special tokens).
    """
    tok = tokenizer or ByteTokenizer()
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt_ids" in row:
            examples.append(SFTExample(tuple(row["prompt_ids"]), tuple(row["completion_ids"])))
        elif "prompt" in row:
            prompt = tok.encode(row["prompt"], bos=True)
            examples.append(SFTExample(tuple(prompt), tuple(tok.encode(row["completion"], eos=True))))
        else:
            raise ValueError(f"{path}:{n}: expected prompt/completion or prompt_ids/completion_ids")
    return examples


def main(
    data: Path,
    out: Path,
    *,
    model: str = "tiny",
    init: Path | None = None,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[float]:
    """``rlbus pretrain``: warm-start a policy on a JSONL file and write a weights-only checkpoint.

    ``model`` names a `PolicyConfig` preset (``tiny`` or ``bench``) for a fresh policy seeded with
    ``seed``; ``init`` starts from an existing checkpoint (file or directory) instead. The result goes to
    the checkpoint directory ``out`` (step 0, version 0, no optimizer state), which the trainer resumes from.
    """
    examples = load_examples(data)
    if init is not None:
        state = load_checkpoint(init)
        if state is None:
            raise FileNotFoundError(f"no checkpoint in {init}")
        policy = policy_from_state(state)
    else:
        presets = {"tiny": PolicyConfig.tiny, "bench": PolicyConfig.bench}
        if model not in presets:
            raise ValueError(f"unknown model preset {model!r}; choose from {', '.join(presets)}")
        torch.manual_seed(seed)
        policy = Policy(presets[model]())
    every = max(1, steps // 20)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}  loss {loss:.4f}")

    log(f"{len(examples)} examples, {policy.num_params():,} parameters")
    losses = pretrain(policy, examples, steps, lr, batch_size, seed, on_step=report)
    path = save_checkpoint(
        out,
        TrainerState(step=0, version=0, model=policy.state_dict(), policy_config=policy_config_dict(policy.config)),
    )
    log(f"wrote {path}")
    return losses

"""Supervised warm start: cross-entropy on reference tokens, so RL starts from a model that is sometimes
right.

GRPO learns only from groups whose rewards differ. A randomly initialised policy essentially never answers
correctly, every group scores the same, every advantage is 0 and RL has no gradient. A short supervised
phase on reference sequences fixes that. Example j is a token sequence x_1 … x_{T_j} with a mask m_t that
marks the tokens the model itself would write (a completion; in a multi-turn chat, the assistant turns and
each one's end-of-turn token, never the prompt, the headers or a tool's output):

    L = (1 / Σ_j Σ_t m_t) · Σ_j Σ_t m_t · −log π(x_t | x_<t)        (+ the MoE balancing loss)

a token-level mean over trained tokens only: everything else is context, not something to imitate.
Batches are drawn without replacement from a seeded permutation (a fresh one each epoch); AdamW with
gradient-norm clipping at 1. Sequences are packed exactly like RL rollouts (`rlbus.training.batch.pack`)
with m as the loss mask, and scored like them: hidden states projected onto the LM head a chunk of trained
tokens at a time (`rlbus.rl.logprobs.chunked_token_logprobs`), for any `rlbus.models.base.TrainableLM`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rlbus.models.base import TrainableLM
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.rl.logprobs import chunked_token_logprobs
from rlbus.training.batch import Sample, pack
from rlbus.training.checkpoint import TrainerState, load_checkpoint, model_from_state, save_checkpoint


@dataclass(frozen=True)
class SFTExample:
    """A token sequence and which of its tokens the model is trained to produce."""

    token_ids: tuple[int, ...]
    trained: tuple[bool, ...]
    """Per token: True where the model writes it (the loss covers it), False for context."""

    def __post_init__(self) -> None:
        if len(self.trained) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.trained)} loss-mask entries")
        if not any(self.trained):
            raise ValueError("an SFT example needs at least one trained token")
        if self.trained[0]:
            raise ValueError("the first token cannot be trained: nothing before it predicts it")

    @classmethod
    def from_completion(cls, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> SFTExample:
        """A prompt (context, at least one token) followed by the completion trained after it."""
        if not prompt_ids or not completion_ids:
            raise ValueError("an SFT example needs a non-empty prompt and a non-empty completion")
        trained = (False,) * len(prompt_ids) + (True,) * len(completion_ids)
        return cls(tuple(prompt_ids) + tuple(completion_ids), trained)


class ChatRenderer(Protocol):
    """What `load_examples` needs to read chat rows (`rlbus.envs.chat.ChatFormat` implements it)."""

    def render_messages(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[bool]]:
        """(ids, trained): True exactly on assistant content tokens and each assistant turn's end-of-turn."""
        ...


def _sample(example: SFTExample) -> Sample:
    T = len(example.token_ids)
    return Sample(
        token_ids=torch.tensor(example.token_ids, dtype=torch.long),
        loss_mask=torch.tensor(example.trained, dtype=torch.bool),
        logprobs=torch.zeros(T),
        versions=torch.full((T,), -1, dtype=torch.long),
    )


def pretrain(
    model: TrainableLM,
    examples: Sequence[SFTExample],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    *,
    weight_decay: float = 0.0,
    logprob_chunk: int = 1024,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps; returns the cross-entropy of every step.

    ``on_step(step, loss)`` is called after each step (progress output). The batch order depends only on
    ``seed``, so two runs from the same weights give the same losses. ``logprob_chunk`` trained tokens are
    projected onto the vocabulary at a time.
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
        out = model.features(batch.inputs, key_mask=batch.key_mask)
        logp = chunked_token_logprobs(
            out.hidden, model.output_weight(), batch.targets, batch.temperature, mask=batch.loss_mask,
            chunk_tokens=logprob_chunk,
        )  # [B, S], 0 off the mask
        ce = -logp.sum() / batch.loss_mask.sum().clamp(min=1)
        loss = ce if out.aux_loss is None else ce + out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(ce.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def load_examples(
    path: Path, chat: ChatRenderer | None = None, *, tokenizer: ByteTokenizer | None = None
) -> list[SFTExample]:
    """Examples from a JSONL file, one object per line, as text, as token ids or as a chat:

    ``{"prompt": "3+4=", "completion": "7"}`` — byte-tokenized: BOS + prompt, completion + EOS;
    ``{"prompt_ids": [...], "completion_ids": [...]}`` — taken as is (any chat format, any special tokens);
    ``{"messages": [{"role": "user", "content": ...}, ...]}`` — rendered by ``chat.render_messages``,
    training the assistant turns only (needs ``chat``); an optional ``"tools"`` list of JSON function
    schemas goes into the system message as the template writes it (tool-use trajectories).
    """
    tok = tokenizer or ByteTokenizer()
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            if "messages" in row:
                if chat is None:
                    raise ValueError("a chat row (messages) needs a chat format to render it")
                tools = {"tools": row["tools"]} if row.get("tools") else {}
                ids, trained = chat.render_messages(row["messages"], **tools)
                examples.append(SFTExample(tuple(ids), tuple(bool(t) for t in trained)))
            elif "prompt_ids" in row:
                examples.append(SFTExample.from_completion(row["prompt_ids"], row["completion_ids"]))
            elif "prompt" in row:
                prompt = tok.encode(row["prompt"], bos=True)
                examples.append(SFTExample.from_completion(prompt, tok.encode(row["completion"], eos=True)))
            else:
                raise ValueError("expected prompt/completion, prompt_ids/completion_ids or messages")
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
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
    device: str = "auto",
) -> list[float]:
    """``rlbus pretrain``: warm-start a model on a JSONL file and write a weights-only checkpoint.

    ``model`` names what to start from (`rlbus.models.sources.parse_model`: ``tiny`` / ``bench`` policy presets
    seeded with ``seed``, a shipped HF model, a model directory or a GGUF file); ``init`` starts from an
    existing checkpoint (file or directory, any model kind) instead. Chat rows (``messages``) are rendered
    in that model's chat format. The result goes to the checkpoint directory ``out`` (step 0, version 0, no
    optimizer state), which the trainer resumes from. Trains on ``device`` (`rlbus.models.device`); the
    checkpoint is written from CPU copies.
    """
    from rlbus.models.device import resolve_device
    from rlbus.models.sources import ModelSource, parse_model

    policy: TrainableLM
    if init is not None:
        state = load_checkpoint(init)
        if state is None:
            raise FileNotFoundError(f"no checkpoint in {init}")
        policy = model_from_state(state)
        source = ModelSource.of(policy, device=str(resolve_device(device)))
        policy = policy.to(resolve_device(device))  # type: ignore[attr-defined]
    else:
        source = parse_model(model, device=device, progress=log)
        policy = source.build(seed=seed)
    examples = load_examples(data, source.chat)
    every = max(1, steps // 20)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}  loss {loss:.4f}")

    log(f"{len(examples)} examples, {sum(p.numel() for p in policy.parameters()):,} parameters")
    losses = pretrain(policy, examples, steps, lr, batch_size, seed, on_step=report)
    path = save_checkpoint(
        out, TrainerState(step=0, version=0, model={k: v.cpu() for k, v in policy.state_dict().items()},
                          model_description=policy.describe())
    )
    log(f"wrote {path}")
    return losses

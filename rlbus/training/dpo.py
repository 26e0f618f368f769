"""Offline DPO before RL: preference pairs in, a policy that prefers the chosen responses out.

Each `PreferencePair` (`rlbus.training.preference`) is scored by its sequence log-probs under the trained
policy and under the reference, the frozen weights the stage starts from:

    log π(y | x) = Σ_t m_t · log π(y_t | y_<t)        (length_normalize: divided by Σ_t m_t)

over the response's trained tokens m (the model's own tokens: assistant content and end-of-turn, never the
prompt or role headers), and the loss is `rlbus.rl.preference.preference_loss` (DPO or IPO) of the four
numbers per pair, averaged over a batch of pairs. The reference's log-probs are computed once, before the
first step and without gradients, so no second copy of the model is kept; held-out pairs get theirs at the
same time, from the same weights. A step packs the batch's chosen and rejected sides into one right-padded
forward (`rlbus.training.batch.pack`, as RL rollouts) and scores them a chunk of trained tokens at a time
(`rlbus.rl.logprobs.chunked_token_logprobs`, temperature 1), for any `rlbus.models.base.TrainableLM`.
AdamW on the fp32 weights (optionally under bf16 autocast), gradient-norm clipping, and batches drawn
without replacement from a seeded permutation, a fresh one each epoch (as `rlbus.training.sft.pretrain`).

Data (`load_preference_data`) is JSONL in the token form of `PreferencePair`, plain text, or the
conversational preference formats other trainers use, rendered with the model's chat format.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbus.models.base import TrainableLM
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.rl.logprobs import chunked_token_logprobs
from rlbus.rl.preference import PreferenceTerms, preference_loss
from rlbus.training.batch import pack
from rlbus.training.config import DPOConfig
from rlbus.training.preference import PreferencePair
from rlbus.training.ranks import Ranks
from rlbus.training.sft import ChatRenderer, SFTExample, _sample
from rlbus.training.step import bf16_compute

__all__ = [
    "DPOConfig", "DPOEval", "DPOResult", "DPOStep", "evaluate_preferences", "load_preference_data",
    "reference_logprobs", "sequence_logprobs", "split_pairs", "train_dpo",
]

# ----------------------------------------------------------------------------------------------------------
# scoring


def _score(
    model: TrainableLM, sides: Sequence[SFTExample], *, length_normalize: bool, chunk: int, dtype: str, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(log π of each side [N], the MoE aux loss | None, real input positions fed)."""
    device = next(model.parameters()).device
    N = len(sides)
    batch = pack([_sample(s) for s in sides], torch.zeros(N), pad_id=pad_id).to(device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16_compute(dtype, device)):
        out = model.features(batch.inputs, key_mask=batch.key_mask)
        logp = chunked_token_logprobs(
            out.hidden, model.output_weight(), batch.targets, torch.ones_like(batch.temperature), mask=batch.loss_mask,
            chunk_tokens=chunk,
        )  # [B, S], 0 off the mask
    per_side = torch.zeros(N, device=device).index_add(0, batch.sample_index, logp.sum(-1))  # [N]
    if length_normalize:
        counts = torch.zeros(N, device=device).index_add(0, batch.sample_index, batch.loss_mask.sum(-1).float())
        per_side = per_side / counts  # [N]; every side has >= 1 trained token (SFTExample)
    return per_side, out.aux_loss, int(batch.key_mask.sum())


def sequence_logprobs(
    model: TrainableLM,
    sides: Sequence[SFTExample],
    *,
    length_normalize: bool = False,
    chunk: int = 1024,
    dtype: str = "float32",
    pad_id: int = 0,
) -> torch.Tensor:
    """log π(response) [N] of each sequence: the sum (or mean) of its trained tokens' log-probs at
    temperature 1, from one packed forward. Differentiable when grad is enabled."""
    if not sides:
        raise ValueError("sequence_logprobs needs at least one sequence")
    return _score(model, sides, length_normalize=length_normalize, chunk=chunk, dtype=dtype, pad_id=pad_id)[0]


def _pair_logprobs(
    model: TrainableLM, pairs: Sequence[PreferencePair], config: DPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(chosen [P], rejected [P], aux loss | None, positions fed) from one forward over both sides."""
    P = len(pairs)
    logp, aux, fed = _score(
        model, [p.chosen for p in pairs] + [p.rejected for p in pairs], length_normalize=config.length_normalize,
        chunk=config.logprob_chunk, dtype=config.compute_dtype, pad_id=config.pad_id,
    )  # [2P]
    return logp[:P], logp[P:], aux, fed


def reference_logprobs(
    model: TrainableLM, pairs: Sequence[PreferencePair], config: DPOConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_chosen [P], ref_rejected [P]) on the CPU: the model's current weights, no grad, scored in
    batches of ``config.batch_size`` pairs exactly as a training step scores them."""
    return _frozen_logprobs(model, pairs, config or DPOConfig())


def _frozen_logprobs(
    model: TrainableLM, pairs: Sequence[PreferencePair], config: DPOConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = [], []
    with torch.no_grad():
        for a in range(0, len(pairs), config.batch_size):
            c, r, _, _ = _pair_logprobs(model, pairs[a : a + config.batch_size], config)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
    if not chosen:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(chosen), torch.cat(rejected)


# ----------------------------------------------------------------------------------------------------------
# training


@dataclass(frozen=True)
class DPOStep:
    """One optimizer step's metrics (rewards and margins are means over the step's pairs)."""

    step: int
    loss: float
    accuracy: float
    chosen_reward: float
    rejected_reward: float
    margin: float
    grad_norm: float
    tokens_per_s: float
    """Real (non-padding) positions fed, chosen and rejected sides together, per second of the step."""


@dataclass(frozen=True)
class DPOEval:
    """Held-out pairs after ``step`` optimizer steps, against the same frozen reference."""

    step: int
    loss: float
    accuracy: float
    margin: float


@dataclass(frozen=True)
class DPOResult:
    steps: list[DPOStep]
    evals: list[DPOEval]
    """At step 0, every ``eval_every`` steps and after the last step; empty without eval pairs."""


def _terms(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, config: DPOConfig
           ) -> PreferenceTerms:
    return preference_loss(pc, pr, rc.to(pc.device), rr.to(pc.device), beta=config.beta, kind=config.loss,
                           label_smoothing=config.label_smoothing)


def evaluate_preferences(
    model: TrainableLM,
    pairs: Sequence[PreferencePair],
    reference: tuple[torch.Tensor, torch.Tensor],
    config: DPOConfig,
    *,
    step: int = 0,
) -> DPOEval:
    """Preference loss, accuracy (fraction of pairs with a positive margin) and mean margin β·h over
    ``pairs``, given their reference log-probs (`reference_logprobs`)."""
    pc, pr = _frozen_logprobs(model, pairs, config)  # [P], [P]
    terms = _terms(pc, pr, reference[0], reference[1], config)
    return DPOEval(step=step, loss=float(terms.loss), accuracy=float(terms.accuracy),
                   margin=float(terms.margins.mean()))


def train_dpo(
    model: TrainableLM,
    pairs: Sequence[PreferencePair],
    config: DPOConfig,
    *,
    eval_pairs: Sequence[PreferencePair] | None = None,
    on_step: Callable[[DPOStep], None] | None = None,
    ranks: Ranks | None = None,
) -> DPOResult:
    """Train ``model`` in place for ``config.steps`` steps against its own starting weights (see the module
    docstring). ``on_step`` gets each step's metrics (progress output).

    On N ranks (``ranks``; the model sharded with `rlbus.training.ranks.shard_model`) every rank calls this
    with the same pairs and config, so every rank draws the same batch; each trains its contiguous slice
    of it (`Ranks.rows`), its mean loss weighted by its share of the batch, and FSDP *sums* the ranks'
    gradients: the one-process gradient of the batch mean. A rank whose slice is empty still runs the
    forward and backward (every FSDP pass is a collective) with weight 0. The reference and held-out
    log-probs are scored by every rank on all pairs (no gradient: the same forwards in lock-step), and the
    reported metrics are the whole batch's on every rank. The result matches one process to float
    rounding, not bit for bit: each rank pads its own slice and the batch mean is summed in two parts."""
    if not pairs:
        raise ValueError("train_dpo needs at least one pair")
    # The optimizer first: after a forward, FSDP2 leaves the root module's parameters unsharded (plain
    # tensors registered in place of its DTensor shards), and an optimizer built then would step those
    # throwaway copies — the embedding and LM head would never train on N ranks.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    ref = reference_logprobs(model, pairs, config)  # frozen: the weights before any step
    eval_ref = reference_logprobs(model, eval_pairs, config) if eval_pairs else None
    generator = torch.Generator().manual_seed(config.seed)
    evals: list[DPOEval] = []

    def evaluate(step: int) -> None:
        if eval_pairs and eval_ref is not None:
            evals.append(evaluate_preferences(model, eval_pairs, eval_ref, config, step=step))

    evaluate(0)
    order: list[int] = []
    steps: list[DPOStep] = []
    model.train()
    for step in range(config.steps):
        start = time.perf_counter()
        if len(order) < config.batch_size:
            order += torch.randperm(len(pairs), generator=generator).tolist()
        picked, order = order[: config.batch_size], order[config.batch_size :]
        mine, share = picked, 1.0  # this rank's pairs, and their share of the batch
        if ranks is not None:
            a, b = ranks.rows(0, len(picked))
            mine, share = (picked[a:b], (b - a) / len(picked)) if b > a else (picked[:1], 0.0)
        index = torch.tensor(mine)
        pc, pr, aux, fed = _pair_logprobs(model, [pairs[i] for i in mine], config)  # [P], [P]
        terms = _terms(pc, pr, ref[0][index], ref[1][index], config)
        loss = terms.loss if aux is None or not config.aux_loss else terms.loss + aux
        optimizer.zero_grad(set_to_none=True)
        (loss if ranks is None else loss * share).backward()
        clip = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor on N ranks
        optimizer.step()
        if ranks is None:
            metrics = DPOStep(
                step=step, loss=float(terms.loss.detach()), accuracy=float(terms.accuracy),
                chosen_reward=float(terms.chosen_rewards.mean()),
                rejected_reward=float(terms.rejected_rewards.mean()), margin=float(terms.margins.mean()),
                grad_norm=grad_norm, tokens_per_s=fed / max(time.perf_counter() - start, 1e-9),
            )
        else:  # the whole batch's metrics on every rank: sums over the ranks' own pairs
            P, on = len(picked), float(share > 0)
            sums = ranks.sum(torch.tensor([
                float(terms.loss.detach()) * len(mine) * on, float(terms.accuracy) * len(mine) * on,
                float(terms.chosen_rewards.sum()) * on, float(terms.rejected_rewards.sum()) * on,
                float(terms.margins.sum()) * on, fed * on,
            ], dtype=torch.float64, device=ranks.device)).tolist()
            metrics = DPOStep(
                step=step, loss=sums[0] / P, accuracy=sums[1] / P, chosen_reward=sums[2] / P,
                rejected_reward=sums[3] / P, margin=sums[4] / P, grad_norm=grad_norm,
                tokens_per_s=sums[5] / max(time.perf_counter() - start, 1e-9),
            )
        steps.append(metrics)
        if on_step is not None:
            on_step(metrics)
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            evaluate(step + 1)
    if config.steps:
        evaluate(config.steps)
    if ranks is not None and hasattr(model, "reshard"):  # the root's shards registered again (see above), so
        model.reshard()  # an optimizer built next (the RL trainer's) steps the real parameters
    return DPOResult(steps=steps, evals=evals)


def split_pairs(
    pairs: Sequence[PreferencePair], eval_fraction: float, seed: int = 0
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held out): about ``eval_fraction`` of the pairs, drawn with ``seed``. Pairs that share a
    non-empty ``prompt_id`` land on the same side, so no held-out prompt was trained on."""
    if not 0 <= eval_fraction < 1:
        raise ValueError("eval_fraction must be in [0, 1)")
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p.prompt_id or f"\0{i}", []).append(i)
    keys = list(groups)
    target = round(len(pairs) * eval_fraction)
    held: set[int] = set()
    for k in torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist():
        if len(held) >= target:
            break
        held.update(groups[keys[k]])
    if len(held) == len(pairs) and pairs:
        raise ValueError(f"eval_fraction {eval_fraction} leaves no pairs to train on")
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


# ----------------------------------------------------------------------------------------------------------
# data

Messages = list[Mapping[str, Any]]


def _messages(value: Any, role: str) -> Messages:
    """A string as one ``role`` message, or a list of messages as is (each needs a role)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m for m in value):
        return value
    raise ValueError(f"expected a string or a list of messages with roles, got {type(value).__name__}")


def _render(chat: ChatRenderer, prompt: Messages, response: Messages) -> SFTExample:
    """prompt + response rendered in the chat format, trained on the response's assistant tokens only."""
    ids, trained = chat.render_messages(prompt + response)
    context, _ = chat.render_messages(prompt)
    if list(ids[: len(context)]) != list(context):
        raise ValueError("the chat format does not render the prompt as a prefix of prompt + response")
    return SFTExample(tuple(ids), tuple(bool(m) and i >= len(context) for i, m in enumerate(trained)))


def _implicit_prompt(chosen: Messages, rejected: Messages) -> int:
    """How many leading messages the two conversations share: the prompt both responses continue."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise ValueError("chosen and rejected conversations need a shared prompt and a differing response")
    return n


def _pair(row: Mapping[str, Any], chat: ChatRenderer | None, tok: ByteTokenizer) -> PreferencePair:
    if "chosen_ids" in row:
        return PreferencePair.from_json(row)
    if "chosen" not in row or "rejected" not in row:
        raise ValueError("expected chosen_ids/rejected_ids, or chosen and rejected (text or messages)")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    provenance: dict[str, Any] = {"prompt_id": str(row.get("prompt_id", "")), "chosen_reward": row.get("chosen_reward"),
                  "rejected_reward": row.get("rejected_reward")}
    if chat is None:
        if not (isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)):
            raise ValueError("a chat row (messages) needs a chat format to render it; a text row needs a prompt")
        ids = tok.encode(prompt, bos=True)
        return PreferencePair(chosen=SFTExample.from_completion(ids, tok.encode(chosen, eos=True)),
                              rejected=SFTExample.from_completion(ids, tok.encode(rejected, eos=True)),
                              **provenance)
    if prompt is None:
        full_chosen, full_rejected = _messages(chosen, "assistant"), _messages(rejected, "assistant")
        n = _implicit_prompt(full_chosen, full_rejected)
        context = full_chosen[:n]
        chosen_msgs, rejected_msgs = full_chosen[n:], full_rejected[n:]
    else:
        context = _messages(prompt, "user")
        chosen_msgs, rejected_msgs = _messages(chosen, "assistant"), _messages(rejected, "assistant")
    return PreferencePair(chosen=_render(chat, context, chosen_msgs), rejected=_render(chat, context, rejected_msgs),
                          **provenance)


def load_preference_data(
    path: Path, chat: ChatRenderer | None = None, *, tokenizer: ByteTokenizer | None = None
) -> list[PreferencePair]:
    """Pairs from a JSONL file, one object per line, in any of these forms:

    ``{"chosen_ids": [...], "chosen_mask": [...], "rejected_ids": ..., "rejected_mask": ...}`` — the token
    form of `PreferencePair`, taken as is;
    ``{"prompt": "3+4=", "chosen": "7", "rejected": "8"}`` — text: byte-tokenized (BOS + prompt, response +
    EOS) without ``chat``; with it, one user turn and one assistant turn in the chat format;
    ``{"prompt": [messages] | str, "chosen": [assistant messages] | str, "rejected": ...}`` — an explicit
    prompt, rendered with ``chat.render_messages``;
    ``{"chosen": [messages], "rejected": [messages]}`` — whole conversations: the prompt is the messages
    they share at the start, the response the rest.

    Rendered rows train the response's assistant tokens only (never an assistant turn of the prompt).
    ``prompt_id``, ``chosen_reward`` and ``rejected_reward`` are kept when present. A bad row is a
    ValueError naming ``path:line``.
    """
    tok = tokenizer or ByteTokenizer()
    pairs = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, Mapping):
                raise ValueError("expected a JSON object")
            pairs.append(_pair(row, chat, tok))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
    return pairs

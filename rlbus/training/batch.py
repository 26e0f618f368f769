"""Scored groups — the trainer's input — and their packing into one right-padded batch.

A `Sample` is one rollout as the trainer sees it. Every per-token array has length T over the whole
sequence, exactly as in `rlbus.schemas.Rollout`:

    token_ids[t]          the sequence (prompt, model turns, environment output)
    loss_mask[t]          True if the model sampled token t (it is trained); False for prompt/env tokens
    logprobs[t]           log μ(token t) under the behaviour policy (the engine), 0 where not sampled
    versions[t]           policy version that produced token t, −1 where not sampled
    routed_experts[:, t]  experts token t was routed to as an *input* position, [L, T, k]; −1 where
                          it was never fed (each segment's last token)
    allowed               the tokens sampled under a grammar (constrained decoding): their positions [M]
                          and the allowed-token masks [M, W] they were drawn under; the trainer masks its
                          logits there the same way (`rlbus.engines.constraints`)

A `Group` is the G samples of one prompt with their scalar rewards, each other's baseline in GRPO.

Packing. Logits at input position t predict token t+1, so a row covering tokens [s, e) becomes
``inputs = ids[s : e−1]`` and ``targets = ids[s+1 : e]``; the target-aligned arrays (loss mask, behaviour
log-probs) shift by one and routed experts stay input-aligned. A sample whose turns span several context
segments (self-summarization: segment k+1 does not attend to segment k) becomes one row per segment, so
the trainer's forward sees exactly the context the engine saw. Rows are right-padded to the longest row:
under causal attention a real token never sees the padding after it, and ``key_mask`` keeps padding out
of the MoE balancing loss. Padding slots replay experts 0..k−1 (valid ids whose outputs are unused).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlbus.engines.base import GenerationResult
from rlbus.envs.episode import segment_spans
from rlbus.schemas import Reward, Rollout, Turn

Span = tuple[int, int]


@dataclass(frozen=True)
class Sample:
    """One scored rollout's token arrays (layout in the module docstring)."""

    token_ids: torch.Tensor
    """[T] int: the whole sequence."""
    loss_mask: torch.Tensor
    """[T] bool: tokens the model sampled and the trainer trains."""
    logprobs: torch.Tensor
    """[T] float: behaviour log-prob of each sampled token (ignored elsewhere)."""
    versions: torch.Tensor
    """[T] int: policy version that produced each sampled token (−1 elsewhere)."""
    routed_experts: torch.Tensor | None = None
    """[L, T, k] int: the engine's experts per input position, for router replay; None for dense models."""
    temperature: float = 1.0
    """Temperature of the behaviour distribution; the trainer scores log softmax(z / temperature)."""
    segments: tuple[Span, ...] = ()
    """[start, end) of each context segment in order; () means one segment covering [0, T)."""
    allowed_positions: torch.Tensor | None = None
    """[M] long: positions whose token was sampled under an allowed-token mask (ascending); None: none."""
    allowed_bits: torch.Tensor | None = None
    """[M, W] int32: those masks (`rlbus.engines.constraints` layout)."""

    def __post_init__(self) -> None:
        if (self.allowed_positions is None) != (self.allowed_bits is None):
            raise ValueError("allowed_positions and allowed_bits come together")
        if self.allowed_positions is not None and self.allowed_bits is not None:
            positions = self.allowed_positions.long()
            if self.allowed_bits.dim() != 2 or self.allowed_bits.shape[0] != positions.numel():
                raise ValueError(f"allowed_bits {tuple(self.allowed_bits.shape)} do not match "
                                 f"{positions.numel()} allowed positions")
            T = self.token_ids.numel()
            if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= T
                                      or not bool(self.loss_mask.bool()[positions].all())):
                raise ValueError("allowed positions must be sampled (loss-mask) positions of the sequence")
        check_arrays(
            token_ids=tuple(self.token_ids.shape),
            arrays={name: tuple(getattr(self, name).shape) for name in ("loss_mask", "logprobs", "versions")},
            routed_experts=None if self.routed_experts is None else tuple(self.routed_experts.shape),
            temperature=self.temperature,
            segments=self.segments,
            loss_mask=self.loss_mask.bool(),
        )

    @property
    def length(self) -> int:
        return self.token_ids.numel()

    @property
    def spans(self) -> tuple[Span, ...]:
        """The context segments; validated to tile [0, T) in order."""
        return tiling(self.segments, self.length)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.bool().sum())

    def oldest_version(self) -> int | None:
        """min version over the sampled tokens (what staleness is measured from); None without any."""
        v = self.versions.long()[self.loss_mask.bool()]
        v = v[v >= 0]
        return int(v.min()) if v.numel() else None


def tiling(segments: tuple[Span, ...], length: int) -> tuple[Span, ...]:
    """``segments`` (() → one segment over [0, length)), checked to tile [0, length) in order."""
    if not segments:
        return ((0, length),)
    end = 0
    for s, e in segments:
        if s != end or e <= s:
            raise ValueError(f"segments {segments} do not tile [0, {length}) in order")
        end = e
    if end != length:
        raise ValueError(f"segments {segments} do not tile [0, {length}) in order")
    return segments


def check_arrays(
    *,
    token_ids: tuple[int, ...],
    arrays: Mapping[str, tuple[int, ...]],
    routed_experts: tuple[int, ...] | None,
    temperature: float,
    segments: tuple[Span, ...],
    loss_mask: Any,
) -> tuple[Span, ...]:
    """A `Sample`'s invariants, from the arrays' shapes and the loss mask (a tensor or a numpy view, so a
    rollout is checked before any tensor is built); returns the spans. Raises ValueError."""
    T = math.prod(token_ids)
    if len(token_ids) != 1 or T == 0:
        raise ValueError(f"token_ids must be a non-empty [T] tensor, got shape {token_ids}")
    for name, shape in arrays.items():
        if shape != (T,):
            raise ValueError(f"{name} has shape {shape}; token_ids has [{T}]")
    if routed_experts is not None and (len(routed_experts) != 3 or routed_experts[1] != T):
        raise ValueError(f"routed_experts must be [L, {T}, k], got {routed_experts}")
    if not temperature > 0:
        raise ValueError("temperature must be > 0: a greedy rollout has no stochastic policy to train")
    spans = tiling(segments, T)
    for start, _ in spans:
        if bool(loss_mask[start]):
            raise ValueError(f"token {start} opens a context segment: nothing predicts it, so it cannot be trained")
    return spans


@dataclass(frozen=True)
class Group:
    """The G samples of one prompt and their rewards."""

    samples: tuple[Sample, ...]
    rewards: torch.Tensor
    """[G] float: one scalar reward per sample."""
    prompt_id: str = ""

    def __post_init__(self) -> None:
        if len(self.samples) == 0 or self.rewards.shape != (len(self.samples),):
            raise ValueError(
                f"a group needs G >= 1 samples and rewards [G]; got {len(self.samples)} samples, "
                f"rewards {tuple(self.rewards.shape)}"
            )


# ----------------------------------------------------------------------------------------------------------
# building samples


def sample_from_generation(result: GenerationResult) -> Sample:
    """A single-turn `Sample` from an engine result: the prompt is context, the completion is trained."""
    P, N = len(result.prompt_ids), len(result.token_ids)
    routed = None
    if result.routed_experts is not None:
        L, _, k = result.routed_experts.shape
        routed = torch.full((L, P + N, k), -1, dtype=torch.long)  # [L, T, k]; the last token was never fed
        routed[:, : P + N - 1] = result.routed_experts.long()
    return Sample(
        token_ids=torch.tensor(result.prompt_ids + result.token_ids, dtype=torch.long),
        loss_mask=torch.cat([torch.zeros(P, dtype=torch.bool), torch.ones(N, dtype=torch.bool)]),
        logprobs=torch.cat([torch.zeros(P), result.logprobs.float()]),
        versions=torch.tensor([-1] * P + list(result.policy_versions), dtype=torch.long),
        routed_experts=routed,
        temperature=result.logprob_spec.temperature,
        allowed_positions=None if result.allowed is None else torch.arange(P, P + N),
        allowed_bits=result.allowed,
    )


def context_segments(turns: Sequence[Turn], length: int) -> tuple[Span, ...]:
    """The rows a rollout trains as: its context segments (see `rlbus.envs.episode.segment_spans`), or ()
    when it has only one; the segments must cover all ``length`` tokens."""
    ordered = tuple(segment_spans(list(turns)))
    if len(ordered) <= 1:
        return ()
    if ordered[0][0] != 0 or ordered[-1][1] != length:
        raise ValueError(f"turn segments {ordered} do not cover the rollout's {length} tokens")
    return ordered


def check_rollout(rollout: Rollout) -> tuple[Span, ...]:
    """What `sample_from_rollout` would raise, without building a tensor: the trainer checks each rollout
    on arrival (a bad one is dead-lettered) and builds its `Sample` once, when it trains it. Returns the
    rollout's context spans."""
    if rollout.token_ids.numel == 0 and rollout.payload is not None:
        raise ValueError(f"rollout {rollout.rollout_id}: arrays are in the blob store; resolve the payload first")
    T = rollout.token_ids.numel
    if rollout.allowed is not None:
        try:
            positions, _ = rollout.allowed.unpack()
        except Exception as exc:  # a corrupt or truncated zstd frame, masks that do not fill [M, words]
            raise ValueError(f"rollout {rollout.rollout_id}: unreadable allowed-token masks: {exc}") from None
        mask = rollout.loss_mask.to_numpy()
        if len(positions) and (positions.min() < 0 or positions.max() >= T or not mask[positions].all()):
            raise ValueError(f"rollout {rollout.rollout_id}: allowed-token masks at positions that were not sampled")
    try:
        return check_arrays(
            token_ids=tuple(rollout.token_ids.shape),
            arrays={"loss_mask": tuple(rollout.loss_mask.shape), "logprobs": tuple(rollout.logprobs.shape),
                    "versions": tuple(rollout.token_versions.shape)},
            routed_experts=None if rollout.routed_experts is None else tuple(rollout.routed_experts.shape),
            temperature=_temperature(rollout),
            segments=context_segments(rollout.turns, T) if len(rollout.token_ids.shape) == 1 else (),
            loss_mask=rollout.loss_mask.to_numpy(),
        )
    except ValueError as exc:
        raise ValueError(f"rollout {rollout.rollout_id}: {exc}") from None


def _temperature(rollout: Rollout) -> float:
    """``logprob_kind = "raw"`` log-probs are of the untempered model: scored at temperature 1."""
    return 1.0 if rollout.sampling.logprob_kind == "raw" else rollout.sampling.temperature


def sample_from_rollout(rollout: Rollout) -> Sample:
    """Decode a `Rollout` message's tensors into a `Sample`.

    The arrays must be inline: a rollout whose arrays live in the blob store (``payload``) has to be
    resolved by the caller first. ``logprob_kind = "raw"`` log-probs are of the untempered model, so the
    trainer scores them at temperature 1.
    """
    if rollout.token_ids.numel == 0 and rollout.payload is not None:
        raise ValueError(f"rollout {rollout.rollout_id}: arrays are in the blob store; resolve the payload first")
    ids = rollout.token_ids.to_torch().long()
    routed = None if rollout.routed_experts is None else rollout.routed_experts.to_torch().long()
    temperature = _temperature(rollout)
    positions = bits = None
    if rollout.allowed is not None:
        p, b = rollout.allowed.unpack()
        positions, bits = torch.from_numpy(p), torch.from_numpy(b)
    try:
        return Sample(
            token_ids=ids,
            loss_mask=rollout.loss_mask.to_torch().bool(),
            logprobs=rollout.logprobs.to_torch().float(),
            versions=rollout.token_versions.to_torch().long(),
            routed_experts=routed,
            temperature=temperature,
            segments=context_segments(rollout.turns, ids.numel()),
            allowed_positions=positions,
            allowed_bits=bits,
        )
    except ValueError as exc:
        raise ValueError(f"rollout {rollout.rollout_id}: {exc}") from None


def groups_from_rollouts(
    rollouts: Iterable[Rollout], rewards: Iterable[Reward], *, source_weights: Mapping[str, float] | None = None
) -> list[Group]:
    """Group rollouts by prompt (first-seen order, members by ``group_index``) and attach their rewards.

    A rollout's reward is Σ weight[source] · value over its `Reward` messages; with ``source_weights``
    None every source weighs 1, otherwise sources not named there are ignored. A rollout without a
    counted reward is an error: the caller (the rollout/reward join) passes complete groups only.
    """
    totals: dict[str, float] = {}
    for r in rewards:
        weight = 1.0 if source_weights is None else source_weights.get(r.source)
        if weight is not None:
            totals[r.rollout_id] = totals.get(r.rollout_id, 0.0) + weight * r.value
    by_prompt: dict[str, list[Rollout]] = {}
    for ro in rollouts:
        by_prompt.setdefault(ro.prompt_id, []).append(ro)
    groups = []
    for prompt_id, members in by_prompt.items():
        members.sort(key=lambda ro: ro.group_index)
        missing = [ro.rollout_id for ro in members if ro.rollout_id not in totals]
        if missing:
            raise ValueError(f"prompt {prompt_id}: no reward for rollout(s) {missing}")
        groups.append(
            Group(
                samples=tuple(sample_from_rollout(ro) for ro in members),
                rewards=torch.tensor([totals[ro.rollout_id] for ro in members], dtype=torch.float32),
                prompt_id=prompt_id,
            )
        )
    return groups


# ----------------------------------------------------------------------------------------------------------
# packing


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded rows ready for one forward; row b is a context segment of sample ``sample_index[b]``."""

    inputs: torch.Tensor
    """[B, S] long: ids fed to the model."""
    targets: torch.Tensor
    """[B, S] long: the token each position predicts."""
    key_mask: torch.Tensor
    """[B, S] bool: real (non-padding) input positions."""
    loss_mask: torch.Tensor
    """[B, S] bool: positions whose target is a trained (sampled) token."""
    behaviour_logprobs: torch.Tensor
    """[B, S] float32: log μ(target) where loss_mask, 0 elsewhere."""
    temperature: torch.Tensor
    """[B] float32: the behaviour temperature of each row."""
    advantages: torch.Tensor
    """[B] float32: the advantage of each row's sample."""
    sample_index: torch.Tensor
    """[B] long: index of the row's sample in the list given to `pack`."""
    routed_experts: torch.Tensor | None
    """[L, B, S, k] long: the engine's experts per input position; None without routing."""
    allowed_index: torch.Tensor | None = None
    """[B, S] long: the row of ``allowed_bits`` whose mask the target was sampled under, −1 where none;
    None when no sample was constrained."""
    allowed_bits: torch.Tensor | None = None
    """[M, W] int32: the allowed-token masks ``allowed_index`` points into."""

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, start: int, stop: int) -> PackedBatch:
        """Rows [start, stop), columns trimmed to the longest of them (less padding per micro-batch)."""
        width = max(1, int(self.key_mask[start:stop].sum(dim=1).max()))
        rows, cols = slice(start, stop), slice(0, width)
        return PackedBatch(
            inputs=self.inputs[rows, cols],
            targets=self.targets[rows, cols],
            key_mask=self.key_mask[rows, cols],
            loss_mask=self.loss_mask[rows, cols],
            behaviour_logprobs=self.behaviour_logprobs[rows, cols],
            temperature=self.temperature[rows],
            advantages=self.advantages[rows],
            sample_index=self.sample_index[rows],
            routed_experts=None if self.routed_experts is None else self.routed_experts[:, rows, cols],
            allowed_index=None if self.allowed_index is None else self.allowed_index[rows, cols],
            allowed_bits=self.allowed_bits,
        )

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(
            inputs=self.inputs.to(device),
            targets=self.targets.to(device),
            key_mask=self.key_mask.to(device),
            loss_mask=self.loss_mask.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            temperature=self.temperature.to(device),
            advantages=self.advantages.to(device),
            sample_index=self.sample_index.to(device),
            routed_experts=None if self.routed_experts is None else self.routed_experts.to(device),
            allowed_index=None if self.allowed_index is None else self.allowed_index.to(device),
            allowed_bits=None if self.allowed_bits is None else self.allowed_bits.to(device),
        )


def pack(samples: Sequence[Sample], advantages: torch.Tensor, *, pad_id: int = 0) -> PackedBatch:
    """One row per context segment of every sample (segments of a single token have nothing to predict).

    Routed experts are kept only if every sample has them: replaying some rows and not others would
    need two forwards, and a batch mixing dense and MoE rollouts means two different models upstream,
    so a mix is an error rather than a silent fallback.
    """
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages must be [{len(samples)}], got {tuple(advantages.shape)}")
    with_routing = [s.routed_experts is not None for s in samples]
    if any(with_routing) and not all(with_routing):
        raise ValueError("some samples carry routed experts and some do not")
    rows = [(i, s, e) for i, sample in enumerate(samples) for s, e in sample.spans if e - s >= 2]
    if not rows:
        raise ValueError("no sample has a segment of two or more tokens: nothing to score")
    B, S = len(rows), max(e - s for _, s, e in rows) - 1
    inputs = torch.full((B, S), pad_id, dtype=torch.long)  # [B, S]
    targets = torch.full((B, S), pad_id, dtype=torch.long)  # [B, S]
    key_mask = torch.zeros(B, S, dtype=torch.bool)  # [B, S]
    loss_mask = torch.zeros(B, S, dtype=torch.bool)  # [B, S]
    behaviour = torch.zeros(B, S)  # [B, S]
    routed: torch.Tensor | None = None
    if all(with_routing) and samples:
        shapes = {(r.shape[0], r.shape[2]) for r in (s.routed_experts for s in samples) if r is not None}
        if len(shapes) != 1:
            raise ValueError(f"samples disagree on routed_experts [L, k]: {sorted(shapes)}")
        L, k = shapes.pop()
        routed = torch.arange(k, dtype=torch.long).expand(L, B, S, k).clone()  # [L, B, S, k] padding: 0..k-1
    for b, (i, s, e) in enumerate(rows):
        sample, n = samples[i], e - s - 1
        ids = sample.token_ids.long()
        inputs[b, :n] = ids[s : e - 1]
        targets[b, :n] = ids[s + 1 : e]
        key_mask[b, :n] = True
        loss_mask[b, :n] = sample.loss_mask.bool()[s + 1 : e]
        behaviour[b, :n] = torch.where(loss_mask[b, :n], sample.logprobs.float()[s + 1 : e], 0.0)
        if routed is not None and sample.routed_experts is not None:
            fed = sample.routed_experts.long()[:, s : e - 1]  # [L, n, k]
            if bool((fed < 0).any()):
                raise ValueError(f"sample {i}: routed experts missing at a position fed to the model")
            routed[:, b, :n] = fed
    allowed_index, allowed_bits = _pack_allowed(samples, rows, S)
    index = torch.tensor([i for i, _, _ in rows], dtype=torch.long)  # [B]
    return PackedBatch(
        inputs=inputs,
        targets=targets,
        key_mask=key_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        temperature=torch.tensor([samples[i].temperature for i, _, _ in rows], dtype=torch.float32),
        advantages=advantages.float()[index],
        sample_index=index,
        routed_experts=routed,
        allowed_index=allowed_index,
        allowed_bits=allowed_bits,
    )


def _pack_allowed(
    samples: Sequence[Sample], rows: Sequence[tuple[int, int, int]], S: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """([B, S] index into the masks, −1 elsewhere; [M, W] the masks) for the rows of `pack`; (None, None)
    when no sample was constrained. A row over [s, e) predicts token p at column p − s − 1."""
    tables = [s.allowed_bits for s in samples if s.allowed_bits is not None]
    if not tables:
        return None, None
    widths = {t.shape[1] for t in tables}
    if len(widths) != 1:
        raise ValueError(f"constrained samples disagree on the mask width: {sorted(widths)}")
    index = torch.full((len(rows), S), -1, dtype=torch.long)  # [B, S]
    offsets, total = {}, 0
    for i, sample in enumerate(samples):
        if sample.allowed_bits is not None:
            offsets[i], total = total, total + sample.allowed_bits.shape[0]
    for b, (i, s, e) in enumerate(rows):
        positions = samples[i].allowed_positions
        if positions is None:
            continue
        positions = positions.long()
        inside = (positions > s) & (positions < e)  # [M_i] targets this row predicts
        index[b, positions[inside] - s - 1] = offsets[i] + inside.nonzero().squeeze(-1)
    return index, torch.cat([t.to(torch.int32) for t in tables])  # [B, S], [M, W]

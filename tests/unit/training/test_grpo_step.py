"""GRPO step: packing alignment, the objective's gradient against a hand-written reference, IS, staleness,
router replay, micro-batching, and building groups from Rollout/Reward messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.engines.base import GenerationResult, LogprobSpec
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Reward, Rollout, SamplingInfo, TensorData, Turn
from rlbus.training.batch import Group, Sample, groups_from_rollouts, pack, sample_from_generation
from rlbus.training.step import GRPOConfig, grpo_step

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def make_sample(
    g: torch.Generator, prompt: int, completion: int, *, version: int = 0, temperature: float = 1.0, routed: bool = True
) -> Sample:
    T = prompt + completion
    mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(completion, dtype=torch.bool)])
    return Sample(
        token_ids=torch.randint(0, 256, (T,), generator=g),
        loss_mask=mask,
        logprobs=torch.where(mask, -5.0 + torch.rand(T, generator=g), 0.0),
        versions=torch.where(mask, version, -1),
        routed_experts=torch.rand(CFG.n_layer, T, CFG.n_experts, generator=g).argsort(-1)[..., : CFG.top_k]
        if routed
        else None,
        temperature=temperature,
    )


def make_groups(seed: int = 0, *, version: int = 0) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    a = (
        make_sample(g, 3, 5, version=version),
        make_sample(g, 6, 2, version=version, temperature=0.7),
        make_sample(g, 2, 7, version=version),
    )
    b = (make_sample(g, 4, 4, version=version), make_sample(g, 5, 6, version=version, temperature=1.3))
    return [Group(samples=a, rewards=torch.tensor([1.0, 0.0, 0.5])), Group(samples=b, rewards=torch.tensor([0.0, 2.0]))]


def new_model(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(CFG)


def grads(model: Policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step_grads(model: Policy, groups: list[Group], config: GRPOConfig) -> dict[str, torch.Tensor]:
    """The gradient grpo_step leaves behind (SGD at lr 0 keeps the weights, so it is the step's own)."""
    grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups, config=config, version=0)
    return grads(model)


# ---------------------------------------------------------------------------------------------------------
# packing


def test_pack_shifts_targets_and_keeps_experts_input_aligned() -> None:
    routed = torch.arange(2 * 5 * 2).view(2, 5, 2) % 4
    s = Sample(
        token_ids=torch.tensor([10, 11, 12, 13, 14]),
        loss_mask=torch.tensor([False, False, True, True, False]),
        logprobs=torch.tensor([0.0, 0.0, -1.0, -2.0, 0.0]),
        versions=torch.tensor([-1, -1, 3, 3, -1]),
        routed_experts=routed,
    )
    short = Sample(
        token_ids=torch.tensor([20, 21]),
        loss_mask=torch.tensor([False, True]),
        logprobs=torch.tensor([0.0, -0.5]),
        versions=torch.tensor([-1, 4]),
        routed_experts=torch.ones(2, 2, 2, dtype=torch.long),
        temperature=0.5,
    )
    b = pack([s, short], torch.tensor([0.25, -1.0]), pad_id=99)
    assert b.inputs.tolist() == [[10, 11, 12, 13], [20, 99, 99, 99]]
    assert b.targets.tolist() == [[11, 12, 13, 14], [21, 99, 99, 99]]
    assert b.key_mask.tolist() == [[True] * 4, [True, False, False, False]]
    assert b.loss_mask.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert b.behaviour_logprobs.tolist() == [[0.0, -1.0, -2.0, 0.0], [-0.5, 0.0, 0.0, 0.0]]
    assert b.advantages.tolist() == [0.25, -1.0] and b.temperature.tolist() == [1.0, 0.5]
    assert b.routed_experts is not None
    assert torch.equal(b.routed_experts[:, 0], routed[:, :4])  # the last token is never fed
    assert b.routed_experts[:, 1, 1:].tolist() == [[[0, 1]] * 3] * 2  # padding replays experts 0..k-1


def test_segments_become_separate_rows() -> None:
    s = Sample(
        token_ids=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        loss_mask=torch.tensor([0, 1, 1, 0, 0, 1, 1]).bool(),
        logprobs=torch.zeros(7),
        versions=torch.tensor([-1, 0, 0, -1, -1, 0, 0]),
        segments=((0, 3), (3, 7)),
    )
    b = pack([s], torch.tensor([1.0]))
    assert b.inputs.tolist() == [[1, 2, 0], [4, 5, 6]]
    assert b.loss_mask.tolist() == [[True, True, False], [False, True, True]]
    assert b.sample_index.tolist() == [0, 0]
    with pytest.raises(ValueError, match="opens a context segment"):
        Sample(
            token_ids=s.token_ids,
            loss_mask=torch.tensor([0, 1, 1, 1, 0, 1, 1]).bool(),
            logprobs=s.logprobs,
            versions=s.versions,
            segments=((0, 3), (3, 7)),
        )


def test_pack_rejects_missing_routing_at_a_fed_position() -> None:
    g = torch.Generator().manual_seed(0)
    s = make_sample(g, 2, 3)
    assert s.routed_experts is not None
    s.routed_experts[:, 2] = -1
    with pytest.raises(ValueError, match="routed experts missing"):
        pack([s], torch.zeros(1))
    with pytest.raises(ValueError, match="some samples carry routed experts"):
        pack([make_sample(g, 2, 3), make_sample(g, 2, 3, routed=False)], torch.zeros(2))


def test_sample_from_generation_aligns_prompt_and_completion() -> None:
    result = GenerationResult(
        request_id="r",
        prompt_ids=(257, 5, 6),
        token_ids=(7, 258),
        logprobs=torch.tensor([-0.1, -0.2]),
        policy_versions=(2, 3),
        text="",
        finish_reason="stop",
        logprob_spec=LogprobSpec(0.8, 1.0, 0),
        routed_experts=torch.tensor([[[0, 1], [1, 2], [2, 3], [3, 0]]], dtype=torch.int16),
    )
    s = sample_from_generation(result)
    assert s.token_ids.tolist() == [257, 5, 6, 7, 258]
    assert s.loss_mask.tolist() == [False, False, False, True, True]
    assert s.versions.tolist() == [-1, -1, -1, 2, 3] and s.oldest_version() == 2
    assert s.logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert s.temperature == 0.8
    assert s.routed_experts is not None and s.routed_experts[0, 4].tolist() == [-1, -1]


# ---------------------------------------------------------------------------------------------------------
# the objective


def reference_loss(model: Policy, groups: list[Group], *, cap: float, replay: bool) -> torch.Tensor:
    """−(1/N) Σ min(π/μ, cap) · A · log π, one unpadded forward per sample (the docstring's objective at r = 1)."""
    samples = [s for grp in groups for s in grp.samples]
    adv = torch.cat([grp.rewards - grp.rewards.mean() for grp in groups])
    n = sum(s.num_loss_tokens for s in samples)
    total = torch.zeros(())
    for s, a in zip(samples, adv, strict=True):
        routed = s.routed_experts[:, None, :-1] if replay and s.routed_experts is not None else None
        logits = model(s.token_ids[None, :-1], routed_experts=routed).logits[0]  # [T-1, V]
        logp = torch.log_softmax(logits / s.temperature, -1).gather(1, s.token_ids[1:, None])[:, 0]  # [T-1]
        m = s.loss_mask[1:]
        w = (logp.detach() - s.logprobs[1:]).exp().clamp(max=cap)
        total = total - (w * a * logp)[m].sum()
    return total / n


@pytest.mark.parametrize("replay", [False, True])
def test_gradient_matches_the_objective(replay: bool) -> None:
    groups = make_groups()
    config = GRPOConfig(router_replay=replay, aux_loss=False, max_grad_norm=0.0, tis_cap=1.5, normalize_std=False)
    got = step_grads(new_model(), groups, config)
    model = new_model()
    reference_loss(model, groups, cap=1.5, replay=replay).backward()
    want = grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batches_accumulate_to_the_same_gradient() -> None:
    groups = make_groups()
    # Without the balancing loss: its f · P product is per forward, so it is not additive over chunks.
    whole = step_grads(new_model(), groups, GRPOConfig(max_grad_norm=0.0, aux_loss=False))
    chunked = step_grads(new_model(), groups, GRPOConfig(max_grad_norm=0.0, aux_loss=False, micro_batch_rows=2))
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-6, rtol=1e-4, msg=name)


def test_step_updates_weights_and_reports() -> None:
    model = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = grpo_step(model, opt, make_groups(), config=GRPOConfig(), version=0)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert m.optimizer_steps == 1 and m.rows == 5 and m.samples == 5
    assert m.tokens == 5 + 2 + 7 + 4 + 6
    assert m.reward_mean == pytest.approx(3.5 / 5)
    assert m.staleness == {0: 5} and m.stale_dropped == 0
    assert m.kl_k3 > 0 and m.max_abs_dlogprob > 0 and 0 < m.is_ess <= 1
    assert m.router_flip_rate is not None and m.router_flip_rate > 0.2  # random "engine" experts
    assert m.clip_fraction == 0.0 and m.mask_fraction == 0.0  # one update: r = 1; TIS keeps everything
    assert m.grad_norm > 0 and np.isfinite(m.loss)


def test_bf16_autocast_scores_differently_but_trains() -> None:
    groups = make_groups()
    fp32 = grpo_step(
        new_model(), torch.optim.SGD(new_model().parameters(), lr=0.0), groups, config=GRPOConfig(), version=0
    )
    model = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bf16 = grpo_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        groups,
        config=GRPOConfig(compute_dtype="bfloat16"),
        version=0,
    )
    assert bf16.optimizer_steps == 1 and np.isfinite(bf16.grad_norm) and bf16.grad_norm > 0
    assert bf16.kl_k3 != fp32.kl_k3  # bf16 matmuls: other trainer log-probs
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())  # master weights stay fp32
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_minibatches_take_several_optimizer_steps_and_can_clip() -> None:
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    m = grpo_step(
        model,
        opt,
        make_groups(),
        config=GRPOConfig(minibatches=2, eps_low=0.01, eps_high=0.01, max_grad_norm=0.0),
        version=0,
    )
    assert m.optimizer_steps == 2
    assert m.clip_fraction > 0  # the second minibatch's ratios moved away from 1 after the first step


# ---------------------------------------------------------------------------------------------------------
# replay, IS, staleness


def on_policy_groups(model: Policy) -> list[Group]:
    """Behaviour log-probs = the model's own, computed while routing to the samples' recorded experts."""
    out = []
    for grp in make_groups(3):
        samples = []
        for s in grp.samples:
            assert s.routed_experts is not None
            with torch.no_grad():
                logits = model(s.token_ids[None, :-1], routed_experts=s.routed_experts[:, None, :-1]).logits[0]
            lp = torch.log_softmax(logits / s.temperature, -1).gather(1, s.token_ids[1:, None])[:, 0]
            behaviour = torch.cat([torch.zeros(1), torch.where(s.loss_mask[1:], lp, 0.0)])
            samples.append(
                Sample(
                    token_ids=s.token_ids,
                    loss_mask=s.loss_mask,
                    logprobs=behaviour,
                    versions=s.versions,
                    routed_experts=s.routed_experts,
                    temperature=s.temperature,
                )
            )
        out.append(Group(samples=tuple(samples), rewards=grp.rewards))
    return out


def test_router_replay_removes_the_routing_mismatch() -> None:
    model = new_model()
    groups = on_policy_groups(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    replayed = grpo_step(model, sgd, groups, config=GRPOConfig(router_replay=True), version=0)
    own = grpo_step(model, sgd, groups, config=GRPOConfig(router_replay=False), version=0)
    assert replayed.max_abs_dlogprob < 1e-4 and replayed.kl_k3 < 1e-8
    assert own.max_abs_dlogprob > 1e-3 and own.kl_k3 > 100 * max(replayed.kl_k3, 1e-12)
    # The flip rate is the trainer router's own top-k against the recorded experts, replay or not.
    assert replayed.router_flip_rate == own.router_flip_rate and own.router_flip_rate is not None
    assert own.router_flip_rate > 0.2


def test_mis_masks_sequences_outside_the_band() -> None:
    model = new_model()
    groups = on_policy_groups(model)
    s = groups[1].samples[0]
    shifted = Sample(
        token_ids=s.token_ids,
        loss_mask=s.loss_mask,
        logprobs=torch.where(s.loss_mask, s.logprobs + 2, 0),
        versions=s.versions,
        routed_experts=s.routed_experts,
        temperature=s.temperature,
    )
    groups[1] = Group(samples=(shifted, groups[1].samples[1]), rewards=groups[1].rewards)
    config = GRPOConfig(is_mode="mis", is_level="sequence", mis_low=0.5, mis_high=2.0)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups, config=config, version=0)
    assert m.mask_fraction == pytest.approx(s.num_loss_tokens / m.tokens)  # ρ = e^-2 < 0.5: that sequence only
    assert m.is_ess == pytest.approx(1.0, abs=1e-4)  # the kept tokens are on-policy: every weight ≈ 1


def test_stale_rollouts_are_dropped() -> None:
    groups = make_groups(version=5)
    g = torch.Generator().manual_seed(9)
    groups.append(
        Group(
            samples=(make_sample(g, 3, 4, version=1), make_sample(g, 3, 5, version=3)), rewards=torch.tensor([0.0, 1.0])
        )
    )
    model = new_model()
    m = grpo_step(
        model, torch.optim.SGD(model.parameters(), lr=0.0), groups, config=GRPOConfig(max_staleness=2), version=5
    )
    assert m.staleness == {0: 5, 2: 1, 4: 1}
    assert m.stale_dropped == 1 and m.samples == 7 and m.rows == 6
    assert m.tokens == 24 + 5


def test_nothing_fresh_means_no_update() -> None:
    model = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = grpo_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        make_groups(version=0),
        config=GRPOConfig(max_staleness=1),
        version=3,
    )
    assert m.optimizer_steps == 0 and m.tokens == 0 and m.stale_dropped == 5 and m.staleness == {3: 5}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rollout_newer_than_the_trainer_is_an_error() -> None:
    model = new_model()
    with pytest.raises(ValueError, match="newer than the trainer"):
        grpo_step(
            model, torch.optim.SGD(model.parameters(), lr=0.0), make_groups(version=4), config=GRPOConfig(), version=3
        )


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        GRPOConfig(mis_low=2.0, mis_high=1.0)
    with pytest.raises(ValueError):
        GRPOConfig(minibatches=0)


# ---------------------------------------------------------------------------------------------------------
# from bus messages


def rollout(
    rid: str, prompt_id: str, index: int, ids: list[int], mask: list[int], *, segments: bool = False, raw: bool = False
) -> Rollout:
    T = len(ids)
    turns = [Turn(role="user", text="", start=0, end=3), Turn(role="assistant", text="", start=3, end=T, segment=1)]
    return Rollout(
        rollout_id=rid,
        prompt_id=prompt_id,
        group_index=index,
        group_size=2,
        token_ids=TensorData.from_numpy(np.asarray(ids, dtype=np.int32)),
        loss_mask=TensorData.from_numpy(np.asarray(mask, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.where(np.asarray(mask) > 0, -0.5, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(np.asarray(mask) > 0, 7, -1).astype(np.int32)),
        routed_experts=TensorData.from_numpy(np.zeros((2, T, 2), dtype=np.int16)),
        turns=turns if segments else [],
        sampling=SamplingInfo(temperature=0.6, logprob_kind="raw" if raw else "sampled"),
    )


def test_groups_from_rollouts_joins_rewards_by_source() -> None:
    rollouts = [
        rollout("b1", "p2", 1, [1, 2, 3, 4], [0, 0, 1, 1]),
        rollout("a1", "p1", 1, [1, 2, 3, 4, 5], [0, 0, 0, 0, 1], segments=True, raw=True),
        rollout("a0", "p1", 0, [1, 2, 3], [0, 1, 1]),
        rollout("b0", "p2", 0, [5, 6, 7], [0, 1, 1]),
    ]
    rewards = [
        Reward(reward_id="1", rollout_id="a0", prompt_id="p1", source="verifier", value=1.0),
        Reward(reward_id="2", rollout_id="a0", prompt_id="p1", source="judge", value=0.5),
        Reward(reward_id="3", rollout_id="a1", prompt_id="p1", source="verifier", value=0.0),
        Reward(reward_id="4", rollout_id="b0", prompt_id="p2", source="verifier", value=2.0),
        Reward(reward_id="5", rollout_id="b1", prompt_id="p2", source="verifier", value=3.0),
        Reward(reward_id="6", rollout_id="b1", prompt_id="p2", source="user", value=-9.0),
    ]
    groups = groups_from_rollouts(rollouts, rewards, source_weights={"verifier": 1.0, "judge": 2.0})
    assert [grp.prompt_id for grp in groups] == ["p2", "p1"]
    assert groups[0].rewards.tolist() == [2.0, 3.0]  # the "user" source is not counted
    assert groups[1].rewards.tolist() == [2.0, 0.0]  # 1.0 + 2 · 0.5
    a0, a1 = groups[1].samples
    assert a0.token_ids.tolist() == [1, 2, 3] and a0.oldest_version() == 7 and a0.temperature == 0.6
    assert a1.segments == ((0, 3), (3, 5)) and a1.temperature == 1.0  # raw log-probs: untempered
    assert a0.routed_experts is not None and a0.routed_experts.shape == (2, 3, 2)
    with pytest.raises(ValueError, match="no reward"):
        groups_from_rollouts(rollouts, rewards[:3])


def test_check_rollout_refuses_what_sample_from_rollout_refuses_without_building_tensors() -> None:
    from msgspec.structs import replace

    from rlbus.training.batch import check_rollout, sample_from_rollout

    good = rollout("a1", "p1", 1, [1, 2, 3, 4, 5], [0, 0, 0, 0, 1], segments=True)
    assert check_rollout(good) == ((0, 3), (3, 5)) == sample_from_rollout(good).spans
    short = TensorData.from_numpy(np.zeros(4, dtype=np.float32))
    opens = rollout("a2", "p1", 1, [1, 2, 3, 4, 5], [0, 0, 0, 1, 1], segments=True)  # token 3 opens segment 2
    bad = [
        replace(good, logprobs=short),
        replace(good, routed_experts=TensorData.from_numpy(np.zeros((2, 4, 2), dtype=np.int16))),
        replace(good, sampling=SamplingInfo(temperature=0.0, logprob_kind="sampled")),
        opens,
        replace(good, turns=[Turn(role="user", text="", start=0, end=3),
                             Turn(role="assistant", text="", start=3, end=4, segment=1)]),  # 4 of 5 tokens
    ]
    for message in bad:
        with pytest.raises(ValueError) as built:
            sample_from_rollout(message)
        with pytest.raises(ValueError) as checked:
            check_rollout(message)
        assert str(checked.value) == str(built.value)
        assert str(checked.value).startswith(f"rollout {message.rollout_id}: ")

"""Loss math of `trl_grpo_ext.grpo.losses`: values, gradients against the analytic formulas, metrics, advantages."""

import math

import pytest
import torch

from trl_grpo_ext.grpo.losses import (
    DEFAULT_CLIP,
    DEFAULT_DRO_BETA,
    LOSS_FUNCTIONS,
    degenerate_group_mask,
    degenerate_groups,
    group_advantages,
    policy_loss,
    policy_loss_from_log_ratio,
    token_level_mean,
)


def _batch(seed=0, b=4, t=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = (old + torch.randn(b, t, generator=g) * spread).requires_grad_(True)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    return logp, old, adv, mask


def _grad(loss_type, logp, old, adv, mask, **kw):
    loss, metrics = policy_loss(loss_type, logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad((loss * mask).sum(), logp)
    return loss, metrics, grad


# Ratios 0.5, 1, 1.5 and 5 (0.5 and 5 outside PPO's [0.8, 1.2], 5 outside CISPO's [0, 4]), advantages +2 and -1.
RATIOS = [0.5, 1.0, 1.5, 5.0]
OLD = -1.0  # every token's old log-prob
ADVANTAGES = [2.0, -1.0]


def _by_hand(per_token):
    """(2, 4) per-token losses computed with plain floats: per_token(ratio, logp, advantage, log_ratio)."""
    return torch.tensor(
        [[per_token(r, OLD + math.log(r), a, math.log(r)) for r in RATIOS] for a in ADVANTAGES], dtype=torch.float64
    )


@pytest.mark.parametrize(
    "name, per_token",
    [
        ("importance_sampling", lambda r, logp, a, lr: -r * a),
        # PPO: the pessimistic (smaller) of the plain and clipped objectives, ratio clipped to [0.8, 1.2]
        ("ppo", lambda r, logp, a, lr: -min(r * a, min(max(r, 0.8), 1.2) * a)),
        # CISPO: the clipped ratio [0, 4] as a constant weight on the log-prob
        ("cispo", lambda r, logp, a, lr: -min(max(r, 0.0), 4.0) * a * logp),
        ("cross_entropy", lambda r, logp, a, lr: -logp * a),
        # DRO: log-prob times advantage, less a quadratic penalty 0.5 * 0.05 * log_ratio^2
        ("dro", lambda r, logp, a, lr: -(logp * a - 0.5 * 0.05 * lr**2)),
    ],
)
def test_each_registered_loss_matches_its_formula_by_hand(name, per_token):
    old = torch.full((2, 4), OLD, dtype=torch.float64)
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    loss, _ = LOSS_FUNCTIONS[name](logp, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.ones(2, 4))
    torch.testing.assert_close(loss, _by_hand(per_token))


def test_the_registry_has_every_local_loss_and_the_default_clips():
    assert set(LOSS_FUNCTIONS) == {"importance_sampling", "ppo", "cispo", "cross_entropy", "dro"}
    ratio = torch.tensor([[0.5, 0.9, 1.3, 5.0]]).log()
    zero = torch.zeros(1, 4)
    # the defaults are the bounds the losses apply when none is given: PPO's metrics count 0.5 low, 1.3 and 5 high
    _, ppo = LOSS_FUNCTIONS["ppo"](ratio, zero, torch.ones(1), torch.ones(1, 4))
    assert DEFAULT_CLIP["ppo"] == (0.8, 1.2) and (ppo["clip_low_frac"].item(), ppo["clip_high_frac"].item()) == (
        0.25,
        0.5,
    )
    _, cispo = LOSS_FUNCTIONS["cispo"](ratio, zero, torch.ones(1), torch.ones(1, 4))
    assert DEFAULT_CLIP["cispo"] == (0.0, 4.0) and (cispo["clip_low_frac"].item(), cispo["clip_high_frac"].item()) == (
        0.0,
        0.25,
    )


def test_importance_sampling_value_and_gradient():
    logp, old, adv, mask = _batch()
    loss, metrics, grad = _grad("importance_sampling", logp, old, adv, mask)
    ratio = torch.exp(logp.detach() - old)
    torch.testing.assert_close(loss.detach(), -ratio * adv[:, None])
    torch.testing.assert_close(grad, -ratio * adv[:, None] * mask)
    torch.testing.assert_close(metrics["ratio_mean"], (ratio * mask).sum() / mask.sum())
    assert set(metrics) == {"ratio_mean"}


def test_cispo_gradient_is_clipped_weight_times_advantage():
    logp, old, adv, mask = _batch(spread=1.5)
    low, high = 0.5, 1.5
    loss, metrics, grad = _grad("cispo", logp, old, adv, mask, clip_low=low, clip_high=high)
    ratio = torch.exp(logp.detach() - old)
    clipped = ratio.clamp(low, high)
    assert ((ratio < low) & (mask > 0)).any() and ((ratio > high) & (mask > 0)).any(), "test must hit both bounds"
    torch.testing.assert_close(loss.detach(), -clipped * adv[:, None] * logp.detach())
    # d/dlogp of -sg(clip(r)) * A * logp is -clip(r) * A: clipped tokens keep a gradient, none flows through r.
    torch.testing.assert_close(grad, -clipped * adv[:, None] * mask)
    m = mask > 0
    torch.testing.assert_close(metrics["clip_low_frac"], (ratio[m] < low).float().mean())
    torch.testing.assert_close(metrics["clip_high_frac"], (ratio[m] > high).float().mean())
    torch.testing.assert_close(metrics["clipped_ratio_mean"], clipped[m].mean())
    torch.testing.assert_close(metrics["ratio_mean"], ratio[m].mean())


def test_cispo_defaults_do_not_scale_on_policy_gradient():
    # On-policy (r = 1) the default bounds 0 / 4 leave the weight at 1: CISPO's gradient equals plain REINFORCE's,
    # unlike TRL's cispo with its default epsilon_high=0.2 cap (0.2x).
    logp, _, adv, mask = _batch()
    _, metrics, grad = _grad("cispo", logp, None, adv, mask)
    torch.testing.assert_close(grad, -adv[:, None].expand_as(grad) * mask)
    assert metrics["clip_high_frac"] == 0 and metrics["clip_low_frac"] == 0


def test_on_policy_the_ratio_losses_take_one_gradient():
    # With the sampler's own log-probs as the old ones (on-policy, ratio 1 inside every clip), importance_sampling,
    # ppo and cispo all take -A * grad(logp): their runs differ only in the loss's value. The async sweep compares
    # every loss's asynchronous runs with one set of on-policy runs for this reason (docs/async.md).
    logp, _, adv, mask = _batch(spread=1.0)
    grads = {name: _grad(name, logp, logp.detach(), adv, mask)[2] for name in ("importance_sampling", "ppo", "cispo")}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, -adv[:, None].expand_as(grad) * mask, rtol=0, atol=0, msg=name)
    # off-policy they part
    old = logp.detach() - 0.7
    assert not torch.equal(_grad("ppo", logp, old, adv, mask)[2], _grad("cispo", logp, old, adv, mask)[2])


def test_ppo_zero_gradient_where_clipped():
    logp, old, adv, mask = _batch(spread=0.5)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    loss, metrics, grad = _grad("ppo", logp, old, adv, mask)
    ratio = torch.exp(logp.detach() - old)
    a = adv[:, None]
    inactive = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert (inactive & (mask > 0)).any() and (~inactive & (mask > 0)).any()
    expected_grad = torch.where(inactive, torch.zeros_like(ratio), -ratio * a) * mask
    torch.testing.assert_close(grad, expected_grad)
    torch.testing.assert_close(loss.detach(), -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a))
    m = mask > 0
    torch.testing.assert_close(metrics["clip_high_frac"], (ratio[m] > 1.2).float().mean())


def test_cross_entropy_and_dro():
    logp, old, w, mask = _batch()
    loss, _, grad = _grad("cross_entropy", logp, old, w, mask)
    torch.testing.assert_close(loss.detach(), -logp.detach() * w[:, None])
    torch.testing.assert_close(grad, -w[:, None].expand_as(grad) * mask)

    loss, _, grad = _grad("dro", logp, old, w, mask)
    delta = logp.detach() - old
    expected = -(logp.detach() * w[:, None] - 0.5 * DEFAULT_DRO_BETA * delta**2)
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(grad, -(w[:, None] - DEFAULT_DRO_BETA * delta) * mask)
    _, _, grad_beta = _grad("dro", logp, old, w, mask, beta=0.5)
    torch.testing.assert_close(grad_beta, -(w[:, None] - 0.5 * delta) * mask)


@pytest.mark.parametrize("loss_type", sorted(LOSS_FUNCTIONS))
def test_advantage_shapes_broadcast_alike(loss_type):
    logp, old, adv, mask = _batch(seed=3)
    ref, _ = policy_loss(loss_type, logp, old, adv, mask)
    for shaped in (adv[:, None], adv[:, None].expand(-1, logp.shape[1])):
        other, _ = policy_loss(loss_type, logp, old, shaped, mask)
        torch.testing.assert_close(other, ref)
    assert ref.shape == logp.shape


def test_sequence_level_log_ratio_broadcasts_to_tokens():
    logp, old, adv, mask = _batch(seed=4)
    seq = ((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    loss, metrics = policy_loss_from_log_ratio("importance_sampling", seq, logp, adv, mask)
    assert loss.shape == logp.shape
    torch.testing.assert_close(loss[:, :1].detach(), -torch.exp(seq.detach()) * adv[:, None])
    torch.testing.assert_close(metrics["ratio_mean"], torch.exp(seq.detach()).mean())


def test_bad_arguments_fail_clearly():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="Unknown loss_type 'nope'"):
        policy_loss("nope", logp, old, adv, mask)
    with pytest.raises(ValueError, match="clip_low <= clip_high"):
        policy_loss("cispo", logp, old, adv, mask, clip_low=2.0, clip_high=1.0)
    with pytest.raises(ValueError, match="0 <= clip_low"):
        policy_loss("ppo", logp, old, adv, mask, clip_low=-0.1)


def test_token_level_mean():
    loss = torch.arange(12.0).view(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert token_level_mean(loss, mask).item() == pytest.approx((0 + 1 + 4 + 5 + 6 + 7) / 6)
    assert token_level_mean(loss, mask, normalizer=10).item() == pytest.approx(23 / 10)
    assert token_level_mean(loss, torch.zeros(3, 4)).item() == 0.0


def test_group_advantages_scalings():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 3.0])
    adv, degenerate = group_advantages(rewards, 4, scale_rewards="group")
    g = rewards.view(2, 4)
    expected = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(adv, expected.view(-1))
    assert degenerate.tolist() == [False, False]

    adv, _ = group_advantages(rewards, 4, scale_rewards="batch")
    torch.testing.assert_close(adv, ((g - g.mean(1, keepdim=True)).view(-1)) / (rewards.std() + 1e-4))
    adv, _ = group_advantages(rewards, 4, scale_rewards=False)
    torch.testing.assert_close(adv, (g - g.mean(1, keepdim=True)).view(-1))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 4, scale_rewards="std")
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_float_noise_group_is_degenerate_and_zeroed():
    # 8 identical all-correct completions scored boxed 1.0 + format 0.3: the float mean of eight 1.3's is off by
    # one ulp, so TRL's std is ~1.3e-7 (not 0) and group scaling turns it into advantages of ~1e-3.
    rewards = torch.full((8,), 1.0) + torch.full((8,), 0.3)
    noisy, degenerate = group_advantages(rewards, 8, zero_degenerate=False)
    assert degenerate.tolist() == [True]
    assert noisy.abs().max() > 1e-4  # what TRL trains on
    zeroed, degenerate = group_advantages(rewards, 8)
    assert degenerate.tolist() == [True] and torch.count_nonzero(zeroed) == 0


def test_tolerance_and_nan_and_degenerate_rewards():
    rewards = torch.tensor([0.0, 1e-5, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    assert degenerate_groups(rewards, 4, tol=1e-6).tolist() == [False, False]
    assert degenerate_groups(rewards, 4, tol=1e-4).tolist() == [True, False]
    # An unscorable completion (NaN) is ignored; one scored value left means no signal.
    nan = float("nan")
    assert degenerate_groups(torch.tensor([2.0, nan, 2.0, 2.0, nan, nan, nan, 1.0]), 4).tolist() == [True, True]
    adv, _ = group_advantages(torch.tensor([1.0, nan, 0.0, 1.0]), 4)
    assert adv[1] == 0 and adv[0] > 0 and adv[2] < 0
    # A flat correctness reward marks the group degenerate although a shaping reward varies.
    shaping = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.1, 0.3, 0.2, 0.0])
    correct = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv, degenerate = group_advantages(correct + shaping, 4, degenerate_rewards=correct)
    assert degenerate.tolist() == [True, False]
    assert torch.count_nonzero(adv[:4]) == 0 and torch.count_nonzero(adv[4:]) == 4
    # (N, K) values: degenerate only when every column is flat.
    both = torch.stack([correct, shaping], dim=1)
    assert degenerate_groups(both, 4).tolist() == [False, False]
    assert math.isclose(degenerate.float().mean().item(), 0.5)


def test_degenerate_group_mask_is_the_one_rule_of_both_paths():
    """Flat totals, or a flat named reward column; (N, K) rewards (TRL's normalize_then_sum) need every column flat.
    `group_advantages` (the PyTRIO loop) applies this rule, as the TRL trainer does."""
    shaping = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    correct = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    totals = correct + shaping  # group 0 varies through shaping only, group 1 through correct only, group 2 flat
    assert degenerate_group_mask(totals, 4).tolist() == [False, False, True]
    assert degenerate_group_mask(totals, 4, named_reward=correct).tolist() == [True, False, True]
    assert degenerate_group_mask(totals, 4, named_reward=shaping).tolist() == [False, True, True]
    per_func = torch.stack([correct, shaping], dim=1)
    assert degenerate_group_mask(per_func, 4).tolist() == [False, False, True]
    assert degenerate_group_mask(per_func, 4, 1e-6, per_func[:, 0]).tolist() == [True, False, True]
    for named in (None, correct, shaping):
        _, degenerate = group_advantages(totals, 4, degenerate_rewards=named)
        assert degenerate.tolist() == degenerate_group_mask(totals, 4, named_reward=named).tolist()

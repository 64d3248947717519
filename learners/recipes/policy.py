"""Policy gradient on rollout groups: RLOO advantages and a clipped, KL-regularised surrogate.

A group is K answers the parent sampled for one prompt, each with its verifier's reward. Each
answer's advantage is its reward minus the mean reward of the *other* K - 1 answers (REINFORCE
leave-one-out, Ahmadian et al., 2024): an unbiased baseline that needs no value model, and that
makes a group whose answers all scored alike teach nothing. The loss falls on the answer's own
tokens only, per token:

    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + beta * KL

where ``ratio`` is the policy's token probability over the parent's (the sampling policy, as in
PPO and GRPO: several steps reuse one set of samples) and ``KL`` is the k3 estimate of the KL
divergence to the parent (``exp(ref - lp) - (ref - lp) - 1``, never negative), which keeps the
successor near the adapter it refines. Each answer's token terms are averaged, then the answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DUAL_CLIP = 3.0
"""Dual-clip PPO (Ye et al., 2020): for a negative advantage the surrogate is at least
``DUAL_CLIP * A``, so an answer the policy made much likelier (its ratio above 3, often through
tokens it shares with rewarded answers) stops being pushed down."""


def rloo_advantages(rewards: Sequence[float]) -> list[float]:
    """Each reward minus the mean of the others' (all 0 for a group of one)."""
    k = len(rewards)
    if k < 2:
        return [0.0] * k
    total = sum(rewards)
    return [r - (total - r) / (k - 1) for r in rewards]


def pg_loss(
    policy: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    clip: float,
    beta: float,
) -> torch.Tensor:
    """The clipped surrogate with the KL penalty, mean over answers of each one's mean over its
    tokens. ``policy[i]`` and ``reference[i]`` are answer ``i``'s token log-probabilities (its
    answer tokens, in order) under the policy and under the parent."""
    per_answer = []
    for lp, ref, advantage in zip(policy, reference, advantages, strict=True):
        ratio = torch.exp(lp - ref)
        surrogate = torch.minimum(
            ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage
        )
        if advantage < 0:  # dual clip: a bound on how far a penalised answer is pushed down
            surrogate = torch.maximum(surrogate, DUAL_CLIP * advantage)
        kl = torch.exp(ref - lp) - (ref - lp) - 1.0
        per_answer.append((beta * kl - surrogate).mean())
    return torch.stack(per_answer).mean()

"""The step's loss, gradient and metrics do not depend on how its groups are split across learner ranks.

Two gloo ranks on loopback each take a share of the groups (3 and 2: uneven, ragged), compute
``objective.step_loss`` with all-reducing counts and moments, and average their gradients as DeepSpeed
does; the result must equal one rank processing the whole batch, to 1e-6 in float64, for every
aggregation (with a KL loss term against a reference model) and for every preset (the critic's too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks
from torch import nn

from asyncrl.config.presets import PRESETS, Preset
from asyncrl.learners.batching import pad_batch, sequence_logprobs
from asyncrl.learners.objective import DistReducer, Reducer, StepBatch, step_loss
from asyncrl.learners.policy_losses import AGGREGATIONS

VOCAB, GROUPS, N, MAX_LEN = 11, 5, 4, 6
SPLIT = ([0, 1, 2], [3, 4])  # groups of rank 0 and rank 1
TOL = 1e-6


class TinyLM(nn.Module):
    """Per-token bigram logits: rows and positions are independent, so padding cannot matter."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64))
        self.out = nn.Parameter(torch.randn(8, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb[ids]) @ self.out


class TinyCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.linspace(-1, 1, VOCAB, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.v[ids[:, :-1]]


def make_groups() -> list[list[tuple]]:
    """GROUPS groups of N samples: (prompt, response, behaviour logprobs, reward), ragged lengths."""
    rng = np.random.default_rng(7)
    groups = []
    for _ in range(GROUPS):
        prompt = rng.integers(0, VOCAB, size=rng.integers(1, 4))
        samples = []
        for _ in range(N):
            response = rng.integers(0, VOCAB, size=rng.integers(1, MAX_LEN + 1))
            behaviour = rng.uniform(-3.5, -1.5, size=len(response))
            samples.append((prompt, response, behaviour, float(rng.integers(0, 3)) / 2))
        groups.append(samples)
    return groups


def loss_and_grads(preset: Preset, groups, reducer: Reducer, ranks: int):
    policy, critic, ref = TinyLM(0), TinyCritic(), TinyLM(1)
    rows = [s for g in groups for s in g]
    batch = pad_batch([(p, r, b) for p, r, b, _ in rows], pad_id=0)
    ids = batch["input_ids"]
    logprobs = sequence_logprobs(policy(ids), ids, temperature=1.0)
    with torch.no_grad():
        ref_lp = sequence_logprobs(ref(ids), ids, 1.0) if preset.uses_kl else None
    values = critic(ids) if preset.needs_critic else None
    step = StepBatch(
        rewards=torch.tensor([r for *_, r in rows], dtype=torch.float64),
        group_ids=torch.tensor([i for i, g in enumerate(groups) for _ in g]),
        mask=batch["response_mask"].double(),
        behaviour_logprobs=batch["behaviour_logprobs"].double(),
    )
    out = step_loss(preset, step, logprobs, reducer, ranks, MAX_LEN, ref_logprobs=ref_lp, values=values)
    total = out.policy_loss + (out.value_loss if out.value_loss is not None else 0.0)
    total.backward()
    grads = torch.cat([p.grad.flatten() for m in (policy, critic) for p in m.parameters() if p.grad is not None])
    return grads, out.metrics


def cases() -> dict[str, Preset]:
    kl_in_loss = dataclasses.replace(PRESETS["grpo"], kl_coef=0.1, correction="tis")
    out = {f"aggregation {a}": dataclasses.replace(kl_in_loss, aggregation=a) for a in AGGREGATIONS}
    out.update({f"preset {name}": p for name, p in PRESETS.items()})
    out["ppo + vtrace"] = dataclasses.replace(PRESETS["ppo"], correction="vtrace")
    out["dual clip + icepop"] = dataclasses.replace(
        PRESETS["reinforce_pp"],
        correction="icepop",
        loss_config=dataclasses.replace(PRESETS["reinforce_pp"].loss_config, dual_clip=3.0),
    )
    return out


def _split_rank(rank: int) -> None:
    groups = make_groups()
    for name, preset in cases().items():
        full_grads, full_metrics = loss_and_grads(preset, groups, Reducer(), ranks=1)
        grads, metrics = loss_and_grads(preset, [groups[i] for i in SPLIT[rank]], DistReducer(), ranks=2)
        dist.all_reduce(grads)
        grads /= 2  # DeepSpeed averages gradients over ranks
        assert torch.allclose(grads, full_grads, rtol=0, atol=TOL), (name, (grads - full_grads).abs().max())
        assert full_grads.abs().sum() > 0, name
        assert metrics.keys() == full_metrics.keys(), name
        for key, want in full_metrics.items():
            assert abs(metrics[key] - want) < TOL, (name, key, metrics[key], want)


def test_loss_gradient_and_metrics_are_the_same_on_one_rank_and_split_over_two():
    run_on_ranks(_split_rank, 2)


def test_the_split_is_not_trivial():
    """The shares differ in size and length, and per-rank normalisation would give another gradient."""
    groups = make_groups()
    preset = dataclasses.replace(PRESETS["grpo"], kl_coef=0.0, aggregation="token-mean")
    full, _ = loss_and_grads(preset, groups, Reducer(), ranks=1)
    local = [loss_and_grads(preset, [groups[i] for i in share], Reducer(), ranks=1)[0] for share in SPLIT]
    assert not torch.allclose((local[0] + local[1]) / 2, full, atol=1e-3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_reports_its_correction_metrics(name):
    _, metrics = loss_and_grads(PRESETS[name], make_groups(), Reducer(), ranks=1)
    correction = PRESETS[name].correction
    for key in ("behaviour_kl", f"{correction}_clip_frac", f"{correction}_mean_ratio", f"{correction}_max_ratio"):
        assert np.isfinite(metrics[f"learner/{key}"]), key
    assert ("learner/kl_ref" in metrics) == PRESETS[name].uses_kl
    assert ("learner/value_loss" in metrics) == PRESETS[name].needs_critic

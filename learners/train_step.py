"""One training step of a learner rank's models, and what it needs: the models (``Models``, built by
:func:`build_models`), what the generators sampled with (``ScoredSampling``). Also the forward passes the
rank's loop (``trainer``) takes besides: the weight-sync probe's log-probs and the behaviour mismatch.

:func:`train_step` is a collective: every optimizer step all-reduces gradients, so all ranks run the same
number of mini-batches, and the losses are normalised by global counts (``objective``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.config.presets import Preset
from asyncrl.learners.batching import model_logprobs
from asyncrl.learners.deepspeed_engine import build_engine
from asyncrl.learners.models import IMAGE_PREFIX, build_critic, image_inputs, load_reference, reference_logprobs
from asyncrl.learners.objective import (
    DistReducer,
    Reducer,
    StepBatch,
    StepLoss,
    mean_metrics,
    minibatch_loss,
    minibatch_rows,
    prepare_batch,
    step_loss,
    take_rows,
)
from asyncrl.models.route_replay import RouteReplay
from asyncrl.models.routers import RouterTap, add_aux_loss, choices_of, step_router_metrics


@dataclass
class Models:
    """What a rank trains and scores with: the policy engine, and what the preset needs besides."""

    policy: object  # DeepSpeed engine around the HF causal LM (the only model published to generators)
    critic: object | None = None  # DeepSpeed engine around learners.models.ValueModel
    reference: torch.nn.Module | None = None  # frozen initial policy, for the KL term
    routers: RouterTap | None = None  # a mixture of experts' routers (asyncrl.models.routers); None: the policy's
    replay: RouteReplay | None = None  # their rollout routing replay (asyncrl.models.route_replay); None: ditto

    def __post_init__(self) -> None:
        if self.routers is None:
            self.routers = RouterTap(self.policy)
        if self.replay is None:
            self.replay = RouteReplay(self.policy)


@dataclass(frozen=True)
class ScoredSampling:
    """What the learner must know of the generators' sampling to score their tokens."""

    temperature: float  # pi and mu must be of the same (tempered) distribution
    max_len: int  # generator.max_new_tokens: L_max of seq-mean-token-sum, the overlong penalty's scale


def build_models(learner: LearnerConfig, model_cfg: ModelConfig, algorithm: AlgorithmConfig, steps: int) -> Models:
    preset = algorithm.preset
    policy = build_engine(learner, model_cfg, steps)
    critic = build_critic(learner, model_cfg, steps, algorithm.critic_lr) if preset.needs_critic else None
    reference = load_reference(model_cfg, policy.device) if preset.uses_kl else None
    return Models(policy, critic, reference)


def train_step(
    models: Models,
    batch: dict,
    preset: Preset,
    learner: LearnerConfig,
    sampling: ScoredSampling,
    world: int,
    reducer: Reducer | None = None,
):
    """Forward, the preset's losses, backward, optimizer step(s). Returns (StepLoss, mismatch sums).

    With ``learner.minibatches`` x ``learner.epochs`` == 1: one forward, one optimizer step; pi_prox and
    V_old are the detached outputs of that forward (exact, and free). Above 1: a no_grad forward of the
    policy (and critic) gives pi_prox and V_old once, the whole-batch inputs (advantages, KL reward) are
    computed from them, then every mini-batch takes its own optimizer step -- each a collective over the
    ranks, which all run the same number of mini-batches. The returned metrics average the steps.
    """
    engine = models.policy
    reducer = reducer if reducer is not None else DistReducer()
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    temperature, max_len = sampling.temperature, sampling.max_len
    ref = reference_logprobs(models.reference, batch, temperature) if models.reference is not None else None
    step = StepBatch(
        batch["rewards"],
        batch["group_ids"],
        batch["response_mask"],
        batch["behaviour_logprobs"],
        batch.get("turn_rewards"),
    )
    tap, coef = models.routers, learner.router_aux_loss_coef
    if learner.minibatches * learner.epochs == 1:
        with replaying(models, batch):  # through backward: a checkpointed layer's recompute routes the same
            with tap:
                logprobs, values = _forward(models, batch, temperature)
            out = step_loss(preset, step, logprobs, reducer, world, max_len, ref_logprobs=ref, values=values)
            add_aux_loss(tap, out, coef)
            out.metrics.update(step_router_metrics(tap, reducer) | replay_metrics(models.replay, batch, reducer))
            _optimizer_step(models, out)
        return out, behaviour_mismatch(logprobs.detach(), batch)
    with torch.no_grad(), tap, replaying(models, batch):
        prox, old_values = _forward(models, batch, temperature)
    routing = step_router_metrics(tap, reducer) | replay_metrics(models.replay, batch, reducer)  # the whole batch
    inputs = prepare_batch(preset, step, prox, reducer, ref_logprobs=ref, old_values=old_values)
    outs = []
    for _ in range(learner.epochs):
        for rows in minibatch_rows(step.group_ids, learner.minibatches):
            images = (k for k in batch if k.startswith(IMAGE_PREFIX))
            keys = ("input_ids", "attention_mask", "response_mask", *(["routes"] if "routes" in batch else []), *images)
            sub = {k: batch[k][rows] for k in keys}
            with replaying(models, sub):
                with tap:
                    logprobs, values = _forward(models, sub, temperature)
                out = minibatch_loss(
                    preset, take_rows(step, rows), take_rows(inputs, rows), logprobs, reducer, world, max_len, values
                )
                add_aux_loss(tap, out, coef)
                _optimizer_step(models, out)
            outs.append(out)
    value_loss = torch.stack([o.value_loss.detach() for o in outs]).mean() if outs[0].value_loss is not None else None
    loss = torch.stack([o.policy_loss.detach() for o in outs]).mean()
    metrics = {**mean_metrics([o.metrics for o in outs]), **routing}
    return StepLoss(loss, value_loss, metrics), behaviour_mismatch(prox, batch)


def _forward(models: Models, batch: dict, temperature: float):
    """(log pi (B, T), V (B, T) or None) of the policy and critic on ``batch``'s rows; log pi without the
    full-vocabulary logits (``batching.model_logprobs``)."""
    ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch.get("response_mask")
    logprobs = model_logprobs(models.policy, ids, mask, temperature, scored, inputs=image_inputs(batch))
    values = models.critic(batch["input_ids"], batch["attention_mask"]) if models.critic is not None else None
    return logprobs, values


def replaying(models: Models, batch: dict):
    """The policy's routers take the engine's routes of ``batch`` (rollout routing replay), where it has them."""
    return models.replay.using(batch["routes"].flatten(0, 1)) if "routes" in batch else contextlib.nullcontext()


def replay_metrics(replay: RouteReplay, batch: dict, reducer: Reducer) -> dict[str, float]:
    """With rollout routing replay, over every rank: ``learner/routing_replay_diff``, the share of the token-layers
    replayed (the engine's routes given) where the learner's own top-k would have taken other experts (the
    routing mismatch that replay removes), and ``learner/routing_replayed``, the share of the batch's real
    token-layers replayed (all but each sample's last token, which no engine forward routed)."""
    if "routes" not in batch or not replay:
        return {}
    real = float(batch["attention_mask"].sum()) * len(replay.routers)
    given, differ, real = reducer.sum([float(replay.given), float(replay.differ), real])
    return {"learner/routing_replay_diff": differ / max(given, 1.0), "learner/routing_replayed": given / max(real, 1.0)}


def _optimizer_step(models: Models, out: StepLoss) -> None:
    models.policy.backward(out.policy_loss)
    models.policy.step()
    if out.value_loss is not None:
        models.critic.backward(out.value_loss)
        models.critic.step()


def probe_of(models: Models, ids: list[int]) -> tuple[list[float], list | None]:
    """The weight-sync probe's log-probs and, for a mixture of experts, its expert choices (``choices_of``)."""
    with models.routers:
        logprobs = probe_logprobs(models.policy, ids)
    return logprobs, choices_of(models.routers)


@torch.no_grad()
def probe_logprobs(engine, ids: list[int]) -> list[float]:
    """Log-probs of the weight-sync probe ``ids[1:]`` under the policy, at temperature 1 (``asyncrl.observe.probe``)."""
    x = torch.tensor([ids], device=engine.device)
    logits = engine(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def behaviour_mismatch(logprobs: torch.Tensor, batch: dict) -> tuple[float, float]:
    """Sum and count of |log pi - log mu| over the response tokens that the version this learner holds
    sampled (``batch["same_version"]``), pi at batch start: what ``learner/behaviour_logprob_mismatch``
    averages. Only there are pi and mu the same weights, so only there does the difference measure the
    engines' disagreement and not the policy's change; the learner keeps no older weights, so stale
    tokens are left out, and at a lag of 1 or more few or none remain (the figure is then null). The
    weight-sync probe covers every version (``asyncrl.observe.probe``: ``weights/probe_logprob_diff_max``
    in the same record)."""
    diff = (logprobs - batch["behaviour_logprobs"]).abs() * batch["same_version"]
    return float(diff.sum()), float(batch["same_version"].sum())

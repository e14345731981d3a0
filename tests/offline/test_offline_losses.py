"""The offline modes' losses (learners.offline_losses; models.reward_head's batches and reward head) against a
slow reference in float64: every example run through the model alone (no padding), each token's log-probability
read off its own log-softmax in a Python loop, the loss summed example by example. Ragged batches, padded on the
right and on the left; losses and every parameter's gradient to 1e-6. Then the same losses on 1 rank and split
over 2 gloo ranks (DeepSpeed's gradient average emulated by an all-reduce / world)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks

from asyncrl.learners.offline_losses import (
    PAIR_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    pair_logratio,
    response_logprobs,
    sft_loss,
)
from asyncrl.models.reward_head import RewardModel, pad_pairs

VOCAB, TOL, BETA = 61, 1e-6, 0.5
SIDES = ["right", "left"]


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).double().eval()


def examples(n: int, seed: int, responses: int) -> list[tuple[list[int], tuple[list[int], ...]]]:
    """``n`` (prompt, responses) of different lengths (prompts 1-6 tokens, responses 1-7)."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [(ids(1, 7), tuple(ids(1, 8) for _ in range(responses))) for _ in range(n)]


# ----------------------------------------------------------------------------- the slow references


def loop_logprobs(model, prompt: list[int], response: list[int]) -> list[torch.Tensor]:
    """log pi(response[t] | prompt, response[:t]) for each t: one unpadded sequence, token by token."""
    ids = torch.tensor([[*prompt, *response]])
    logits = model(input_ids=ids).logits[0]
    out = []
    for t, token in enumerate(response):
        row = logits[len(prompt) - 1 + t]
        out.append(row[token] - torch.logsumexp(row, dim=0))
    return out


def loop_reward(reward_model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *response]])
    hidden = reward_model.base(input_ids=ids).last_hidden_state[0]
    return reward_model.head(hidden[-1])[0]


def grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def backward_of(module, loss: torch.Tensor) -> torch.Tensor:
    module.zero_grad()
    loss.backward()
    return grads(module)


# ----------------------------------------------------------------------------- the batched losses


def batched_sft(model, exs, side: str, total_tokens: float, world: int = 1) -> torch.Tensor:
    batch = pad_pairs([(p, rs[0]) for p, rs in exs], pad_id=0, side=side)
    return sft_loss(response_logprobs(model, batch), batch["response_mask"], total_tokens, world)


def batched_dpo(model, exs, reference, side: str, name: str, total: float, world: int = 1) -> torch.Tensor:
    batch = pad_pairs([(p, r) for p, rs in exs for r in rs], pad_id=0, side=side)
    lr = pair_logratio(response_logprobs(model, batch), batch["response_mask"], PAIR_LOSSES[name][1])
    ref = torch.tensor(reference, dtype=torch.float64)
    return dpo_loss(name, BETA, (lr[0::2], lr[1::2]), (ref[:, 0], ref[:, 1]), total, world)[0]


def batched_rm(reward_model, exs, side: str, total: float, world: int = 1) -> torch.Tensor:
    batch = pad_pairs([(p, r) for p, rs in exs for r in rs], pad_id=0, side=side)
    scores = reward_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return bradley_terry_loss(scores[0::2], scores[1::2], total, world)


def reward_model(seed: int = 0) -> RewardModel:
    rm = RewardModel(llama(seed).model, 32).double()
    torch.manual_seed(seed + 1)
    torch.nn.init.normal_(rm.head.weight)  # not the zero start: the gradient reaches the base model
    return rm


def loop_dpo_terms(model, exs, mean: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for prompt, (chosen, rejected) in exs:
        c, r = loop_logprobs(model, prompt, chosen), loop_logprobs(model, prompt, rejected)
        out.append((sum(c) / len(c), sum(r) / len(r)) if mean else (sum(c), sum(r)))
    return out


# ----------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("side", SIDES)
def test_sft_loss_and_gradients_equal_the_token_loop(side):
    model, exs = llama(), examples(5, seed=1, responses=1)
    nll, tokens = 0.0, 0
    for prompt, (response,) in exs:
        for lp in loop_logprobs(model, prompt, response):
            nll, tokens = nll - lp, tokens + 1
    want = nll / tokens
    want_grads = backward_of(model, want)
    loss = batched_sft(model, exs, side, float(tokens))
    assert abs(loss.item() - want.item()) < TOL
    assert torch.allclose(backward_of(model, loss), want_grads, atol=TOL, rtol=0)


@pytest.mark.parametrize("side", SIDES)
def test_reward_model_loss_and_gradients_equal_the_pair_loop(side):
    rm, exs = reward_model(), examples(5, seed=2, responses=2)
    terms = []
    for prompt, (chosen, rejected) in exs:
        margin = loop_reward(rm, prompt, chosen) - loop_reward(rm, prompt, rejected)
        terms.append(-torch.log(1 / (1 + torch.exp(-margin))))  # -log sigmoid, spelled out
    want = sum(terms) / len(exs)
    want_grads = backward_of(rm, want)
    loss = batched_rm(rm, exs, side, float(len(exs)))
    assert abs(loss.item() - want.item()) < TOL
    assert torch.allclose(backward_of(rm, loss), want_grads, atol=TOL, rtol=0)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_dpo_losses_and_gradients_equal_the_pair_loop(side, name):
    exs = examples(5, seed=3, responses=2)
    mean = PAIR_LOSSES[name][1]
    with torch.no_grad():
        reference = [(float(c), float(r)) for c, r in loop_dpo_terms(llama(seed=7), exs, mean)]
    model = llama()
    terms = []
    for (c, r), (ref_c, ref_r) in zip(loop_dpo_terms(model, exs, mean), reference, strict=True):
        h = (c - ref_c) - (r - ref_r)
        terms.append(-torch.log(1 / (1 + torch.exp(-BETA * h))) if name == "sigmoid" else (h - 1 / (2 * BETA)) ** 2)
    want = sum(terms) / len(exs)
    want_grads = backward_of(model, want)
    loss = batched_dpo(model, exs, reference, side, name, float(len(exs)))
    assert abs(loss.item() - want.item()) < TOL and want.item() != pytest.approx(math.log(2))
    assert torch.allclose(backward_of(model, loss), want_grads, atol=TOL, rtol=0)


def test_left_and_right_padding_give_the_same_batch_log_probs():
    model, exs = llama(), examples(4, seed=4, responses=1)
    seqs = [(p, rs[0]) for p, rs in exs]
    right, left = pad_pairs(seqs, 0, "right"), pad_pairs(seqs, 0, "left")
    assert not torch.equal(right["input_ids"], left["input_ids"])
    per_seq = [(response_logprobs(model, b) * b["response_mask"]).sum(-1) for b in (right, left)]
    assert torch.allclose(per_seq[0], per_seq[1], atol=1e-10, rtol=0)


def test_bad_padding_side_and_empty_prompt_are_errors():
    with pytest.raises(ValueError, match="side"):
        pad_pairs([([1], [2])], 0, side="middle")
    with pytest.raises(ValueError, match="empty prompt"):
        pad_pairs([([], [2])], 0)


# ----------------------------------------------------------------------------- 1 rank vs 2 ranks

SPLIT = (slice(0, 3), slice(3, 6))  # rank r's examples of the 6


def _split_rank(rank: int) -> None:
    from asyncrl.learners.objective import DistReducer

    reducer, world = DistReducer(), 2
    sft_exs, pair_exs = examples(6, seed=5, responses=1), examples(6, seed=6, responses=2)
    with torch.no_grad():
        reference = [(float(c), float(r)) for c, r in loop_dpo_terms(llama(seed=7), pair_exs, False)]

    def averaged(module, loss):  # DeepSpeed: each rank's gradient, averaged over the ranks
        g = backward_of(module, loss)
        dist.all_reduce(g)
        return g / world

    mine = SPLIT[rank]
    cases = {
        "sft": (
            llama(),
            lambda m: batched_sft(m, sft_exs, "right", float(sum(len(rs[0]) for _, rs in sft_exs))),
            lambda m: batched_sft(
                m, sft_exs[mine], "right", reducer.sum([float(sum(len(rs[0]) for _, rs in sft_exs[mine]))])[0], world
            ),
        ),
        "dpo": (
            llama(),
            lambda m: batched_dpo(m, pair_exs, reference, "left", "sigmoid", 6.0),
            lambda m: batched_dpo(m, pair_exs[mine], reference[mine], "left", "sigmoid", 6.0, world),
        ),
        "rm": (
            reward_model(),
            lambda m: batched_rm(m, pair_exs, "right", 6.0),
            lambda m: batched_rm(m, pair_exs[mine], "right", 6.0, world),
        ),
    }
    for name, (module, full, split) in cases.items():
        whole = full(module)
        want = backward_of(module, whole)
        part = split(module)
        total = reducer.sum([part.item() / world])[0]  # each rank's share of the logged loss
        assert abs(total - whole.item()) < TOL, (name, total, whole.item())
        diff = (averaged(module, part) - want).abs().max()
        assert diff < TOL, (name, float(diff))


def test_sft_rm_and_dpo_are_the_same_on_one_rank_and_split_over_two():
    run_on_ranks(_split_rank, 2)

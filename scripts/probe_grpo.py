"""Probe: is the demo sort task learnable by GRPO in the regime the real system runs?

A plain single-process torch loop (NOT asyncrl's learner): each step samples ``groups`` train
prompts x ``n`` samples at ``temperature``, scores them with the task reward, normalises rewards
within each group and takes one AdamW step on the token-mean of ``-w * A * log pi``. With
``--lag 1`` each step trains on the batch sampled one version earlier, as the async system does at
``max_policy_lag=1``, and ``w = min(pi / mu, tis_cap)`` corrects for it (w = 1 when on-policy).
Greedy held-out reward is printed every ``eval_every`` steps; the demo wants it to go from <= 0.4
to >= 0.85 within about 50 steps.

Usage: python scripts/probe_grpo.py [--model .cache/models/demo-sort] [--seed 0] [--lr 3e-4] [--lag 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from asyncrl import demo_model as dm
from asyncrl.tasks import sort


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(G, N) rewards -> (G, N) advantages (r - mean) / (std + eps) within each group."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def rollout(model, tokenizer, records: list[dict], n: int, temperature: float, max_new_tokens: int, gen):
    """One group per record: rows of (prompt ids, response ids, behaviour log-probs), (G, N) rewards."""
    rows, rewards = [], []
    for rec in records:
        prompt = tokenizer.encode(rec["prompt"])
        ids = torch.tensor([prompt] * n)
        tokens, logprobs, mask = dm.sample_tokens(
            model, ids, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, temperature, gen
        )
        texts = dm.decode_completions(tokenizer, tokens)
        rewards.append([sort.reward(rec["prompt"], t, rec) for t in texts])
        for i in range(n):
            length = int(mask[i].sum())
            rows.append((prompt, tokens[i, :length].tolist(), logprobs[i, :length]))
    return rows, torch.tensor(rewards)


def policy_loss(model, rows, advantages: torch.Tensor, pad_id: int, temperature: float, tis_cap: float):
    """Token-mean over the whole batch of -min(pi/mu, cap) * A * log pi(response token)."""
    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width))  # (B, W) 1.0 where the token at t is a response token
    behaviour = torch.zeros((len(rows), width))  # (B, W) log mu of response tokens
    for i, (p, r, mu) in enumerate(rows):
        end = len(p) + len(r)
        ids[i, :end] = torch.tensor(p + r)
        att[i, :end] = 1
        resp[i, len(p) : end] = 1.0
        behaviour[i, len(p) : end] = mu
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)  # (B, W-1) log pi
    mask = resp[:, 1:]
    weight = torch.exp(logp.detach() - behaviour[:, 1:]).clamp(max=tis_cap) * mask
    return -(weight * advantages[:, None] * logp * mask).sum() / mask.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".cache/models/demo-sort", help="prepared (or to-be-prepared) model dir")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model recipe and of the RL loop")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak AdamW lr (1e-3 degrades this tiny policy)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lag", type=int, default=1, choices=(0, 1), help="policy lag of the trained batches")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="cap of the token importance weights")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaForCausalLM

    started = time.monotonic()
    path = dm.prepare_demo_model(args.model, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    train, held_out = sort.make_splits(sort.N_TRAIN, sort.N_EVAL, sort.DATA_SEED)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # Cosine decay to 0.1x, as the real learner does (a constant high lr oscillates late).
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    history = [{"step": 0, **dm.greedy_eval(model, tokenizer, held_out), "s": time.monotonic() - started}]
    print(json.dumps(history[-1]), flush=True)

    def sample_batch():
        model.eval()
        return rollout(
            model,
            tokenizer,
            rng.sample(train, args.groups),
            args.n,
            args.temperature,
            args.max_new_tokens,
            gen,
        )

    pending = [sample_batch() for _ in range(args.lag)]
    for step in range(1, args.steps + 1):
        # --- rollout: with lag 1, train on the batch of the previous version, sample the next ---
        pending.append(sample_batch())
        rows, rewards = pending.pop(0)
        # --- learn ---
        model.train()
        adv = group_advantages(rewards).flatten()
        loss = policy_loss(model, rows, adv, tokenizer.pad_token_id, args.temperature, args.tis_cap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        line = {"step": step, "sample_reward": round(rewards.mean().item(), 4), "loss": round(loss.item(), 4)}
        if step % args.eval_every == 0 or step == args.steps:
            line.update(dm.greedy_eval(model, tokenizer, held_out), s=round(time.monotonic() - started, 1))
            history.append(line)
        print(json.dumps(line), flush=True)
    first, last = history[0], history[-1]
    print(
        f"probe seed {args.seed}: greedy eval reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f} "
        f"(exact {first['exact_rate']:.3f} -> {last['exact_rate']:.3f}) in {time.monotonic() - started:.0f}s"
    )


if __name__ == "__main__":
    main()

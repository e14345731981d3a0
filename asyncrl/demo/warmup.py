"""The agentic demo recipes (``demo-calc``, ``demo-guess``): a multi-turn supervised warm-up, and the
measurement of the warmed-up policy by playing the real episodes.

The warm-up, like ``demo-sort``'s (see the comment in ``asyncrl.demo.model``), teaches the FORMAT of a
whole episode exactly but mixes two behaviours per episode, the right one with probability
``right_fraction`` and a systematic mistake otherwise. The two differ at the episode's first token and
share everything else, so the policy learns both to convergence: greedy decoding follows the mistake
(held-out success <= 0.4), while about ``right_fraction`` of temperature-1 episodes are right, the signal
GRPO amplifies. The mistakes:

* calc: the tool is skipped and the first operand answered at once (first token a digit, not ``<``);
  the model cannot multiply in its head, so learning to call the tool is what RL has to do;
* guess: the linear scan (always the smallest number still possible: 1, 2, 3, ...; it finds 4 of 16
  secrets in 4 turns) instead of bisection (first guess 8; it finds 15 of 16).

Loss is only on model-turn tokens and their ``</s>``, never on prompt or observation tokens.

Measurement plays the same episode code the generators run (``asyncrl.demo.calc:episode``, the guess
``Env`` through ``asyncrl.episodes.api.env_episode``) with a transformers ``complete``: every live episode's
next turn is decoded in one batch per context length, episodes in lockstep, so a seed gives the same
figures every time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.demo import calc, guess
from asyncrl.demo.model import build_model, build_tokenizer, sample_tokens

MAX_POSITIONS = 128  # the longest episode (calc: 11 + 80-token budget) and slack; vLLM's max_model_len
SFT_BATCH = 64
# Linear LR warm-up share: Adam at 2e-3 from step 0 left calc's seed 1 at 9% temperature-1 success
# (loss 0.11, far above the floor); with the warm-up seeds 0-2 reach 26-35%.
SFT_WARMUP_SHARE = 0.1
GUESS_TURNS = 4  # bisection finds 15 of 16 secrets in 4 turns, the linear scan 4 of 16
SAMPLE_ROUNDS = 4  # temperature-1 measurement: this many episodes of each held-out record

Segments = list[tuple[str, bool]]  # (text, is_model_turn) of one demonstration episode


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    splits: Callable[[], tuple[list[dict], list[dict]]]
    demonstration: Callable[[dict, random.Random, float], Segments]  # (record, rng, right_fraction)
    right_fraction: float
    sft_steps: int
    sft_lr: float
    max_new_tokens: int  # per model turn; the recipe's config uses the same
    max_tokens: int  # the episode's budget after its prompt; ditto
    max_turns: int


def _calc_demo(record: dict, rng: random.Random, right: float) -> Segments:
    return calc.demonstration(record, use_tool=rng.random() < right)


def _guess_demo(record: dict, rng: random.Random, right: float) -> Segments:
    return guess.demonstration(record, guess.bisect if rng.random() < right else guess.lowest, turns=GUESS_TURNS)


# Tuning (measured, seeds 0-2): calc's right_fraction 0.4, not sort's 0.3: a right calc episode is ~28
# model tokens, and at temperature 1 a stray byte in any of them spoils it (only 55-85% of sampled calls
# are clean), so 0.3 gave 11-16% success; 0.4 gives 26-35% with greedy still 0.0 (the skipping mode
# holds 0.6 of the first token). guess's weak mode still wins 1/4 of its games, so 0.2 keeps
# temperature-1 success near 0.4 (0.2 x 15/16 + 0.8 x 4/16) with greedy at 0.25. Steps and lr: the
# fewest that reach the mixture's entropy floor on every seed tried (calc at 250 steps: 13-16%).
RECIPES = {
    "demo-calc": Recipe(
        "demo-calc",
        lambda: calc.make_splits(calc.N_TRAIN, calc.N_EVAL, calc.DATA_SEED),
        _calc_demo,
        right_fraction=0.4,
        sft_steps=300,
        sft_lr=2e-3,
        max_new_tokens=28,
        max_tokens=80,
        max_turns=2,
    ),
    "demo-guess": Recipe(
        "demo-guess",
        lambda: guess.make_splits(guess.N_TRAIN, guess.DATA_SEED),
        _guess_demo,
        right_fraction=0.2,
        sft_steps=150,
        sft_lr=2e-3,
        max_new_tokens=4,
        max_tokens=64,
        max_turns=GUESS_TURNS,
    ),
}


# ----------------------------------------------------------------------------------- supervised warm-up


def encode_demonstration(tokenizer, segments: Segments) -> tuple[list[int], list[int]]:
    """``(ids, labels)``: each model turn ends with ``</s>`` and is labelled; the rest is -100."""
    ids: list[int] = []
    labels: list[int] = []
    for text, is_model in segments:
        seg = tokenizer.encode(text) + ([tokenizer.eos_token_id] if is_model else [])
        ids += seg
        labels += seg if is_model else [-100] * len(seg)
    return ids, labels


def _sft_batch(tokenizer, rows: Sequence[tuple[list[int], list[int]]]):
    """Right-padded ids and labels (-100 on padding). No attention mask: under causal attention no real
    token ever attends to the padding after it."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    for i, (r, lb) in enumerate(rows):
        ids[i, : len(r)], lab[i, : len(lb)] = torch.tensor(r), torch.tensor(lb)
    return ids, lab


def _sft_step(model, tokenizer, rows: list[tuple[list[int], list[int]]]) -> float:
    """Accumulate the gradient of the batch's mean token loss, in two length buckets: a short
    demonstration (calc without its tool) is not padded to a long one's width."""
    import torch

    rows = sorted(rows, key=lambda r: len(r[0]))
    n_labels = sum(sum(t != -100 for t in lb[1:]) for _, lb in rows)
    half = len(rows) // 2
    total = 0.0
    for bucket in (rows[:half], rows[half:]):
        ids, lab = _sft_batch(tokenizer, bucket)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        (loss / n_labels).backward()
        total += loss.item()
    return total / n_labels


def lr_factor(step: int, steps: int, warmup_share: float = SFT_WARMUP_SHARE) -> float:
    """Linear warm-up over the first ``warmup_share`` of the steps, then cosine decay to 0."""
    warm = max(1, int(warmup_share * steps))
    return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))


def sft_warmup(model, tokenizer, recipe: Recipe, train: Sequence[dict], seed: int, log: Callable[[str], Any]) -> float:
    """The recipe's mixture of demonstrations, cosine-decayed AdamW; returns the last loss."""
    import torch

    rng = random.Random(seed)
    steps = recipe.sft_steps
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, steps=steps))
    model.train()
    for step in range(1, steps + 1):
        rows = [
            encode_demonstration(tokenizer, recipe.demonstration(rec, rng, recipe.right_fraction))
            for rec in rng.sample(train, SFT_BATCH)
        ]
        opt.zero_grad(set_to_none=True)
        loss = _sft_step(model, tokenizer, rows)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            log(f"sft step {step}/{steps}: loss {loss:.3f}")
    return loss


# ----------------------------------------------------------------------------------- playing episodes


class _LockstepModel:
    """``complete`` for many concurrent episodes: a turn waits until every live episode has asked for
    one (or ended); then all are decoded together, one batch per (context length, token limit), in the
    order of the episodes' keys, so the draws of a seeded generator land on the same turns every time."""

    def __init__(self, model, tokenizer, temperature: float, generator):
        self.model, self.tok, self.temperature, self.generator = model, tokenizer, temperature, generator
        self.pending: list[tuple[int, list[int], int, asyncio.Future]] = []

    def complete_for(self, key: int):
        async def complete(ids: list[int], limit: int):
            done = asyncio.get_running_loop().create_future()
            self.pending.append((key, list(ids), limit, done))
            return await done

        return complete

    def decode_pending(self) -> None:
        import torch

        from asyncrl.chat import Completion

        groups: dict[tuple[int, int], list[tuple[int, list[int], int, asyncio.Future]]] = {}
        for req in sorted(self.pending, key=lambda r: r[0]):
            groups.setdefault((len(req[1]), req[2]), []).append(req)
        self.pending = []
        eos = self.tok.eos_token_id
        for (_, limit), reqs in sorted(groups.items()):
            ids = torch.tensor([r[1] for r in reqs])
            tokens, logprobs, mask = sample_tokens(
                self.model, ids, limit, eos, self.tok.pad_token_id, self.temperature, self.generator
            )
            for row, (_, _, _, done) in enumerate(reqs):
                n = int(mask[row].sum())
                toks = tokens[row, :n].tolist()
                finish = "stop" if toks and toks[-1] == eos else "length"
                done.set_result(Completion(toks, logprobs[row, :n].tolist(), finish, [0] * n))


def _episode_parts(recipe: Recipe, options: dict):
    """(episode, tools, parser, reward) of the recipe, as its config loads them."""
    from asyncrl.episodes.api import env_episode
    from asyncrl.episodes.tools import parse_simple

    if recipe.name == "demo-calc":
        return calc.episode, {"calc": calc.calc}, parse_simple, calc.reward
    make_env = lambda: guess.Env(**options)  # noqa: E731
    return env_episode(make_env, recipe.max_turns), {}, parse_simple, guess.reward


async def _play_async(model, tokenizer, recipe: Recipe, records: Sequence[dict], temperature: float, seed: int):
    import torch

    from asyncrl.chat import ChatTokens
    from asyncrl.config import CompletionEpisodeConfig
    from asyncrl.episodes.api import Context, run_episode

    generator = torch.Generator().manual_seed(seed)
    lockstep = _LockstepModel(model, tokenizer, temperature, generator)
    cfg = CompletionEpisodeConfig(max_turns=recipe.max_turns, max_tokens=recipe.max_tokens)
    episode, tools, parser, reward = _episode_parts(recipe, dict(cfg.options))
    chat = ChatTokens(tokenizer)
    contexts = []
    for i, rec in enumerate(records):
        prompt = chat.prompt_ids(rec["prompt"])
        budget = min(recipe.max_tokens, MAX_POSITIONS - len(prompt))
        contexts.append(
            Context(
                task=rec,
                seed=seed * 1_000_003 + i,
                prompt_ids=prompt,
                complete=lockstep.complete_for(i),
                chat=chat,
                budget=budget,
                max_new_tokens=recipe.max_new_tokens,
                cfg=cfg,
                tools=tools,
                parser=parser,
                reward=reward,
            )
        )
    tasks = [asyncio.create_task(run_episode(episode, ctx, cfg.episode_timeout_s)) for ctx in contexts]
    while True:
        while sum(not t.done() for t in tasks) > len(lockstep.pending):
            await asyncio.sleep(0.001)  # tools and rewards run; each live episode ends or asks for a turn
        if not lockstep.pending:
            break
        lockstep.decode_pending()
    return [(ctx, task.result()) for ctx, task in zip(contexts, tasks, strict=True)]


def play(model, tokenizer, recipe: Recipe, records: Sequence[dict], temperature: float = 0.0, seed: int = 0):
    """Play one episode of each record with ``model`` (transformers): ``(Context, Outcome)`` of each, in
    order (see ``asyncrl.episodes.api``). Temperature 0 is greedy."""
    was_training = model.training
    model.eval()
    try:
        return asyncio.run(_play_async(model, tokenizer, recipe, records, temperature, seed))
    finally:
        model.train(was_training)


def success_rate(played) -> float:
    """Share of played episodes that scored 1.0 or more (a failed episode counts as a miss)."""
    return sum(o.reward is not None and o.reward >= 1.0 for _, o in played) / max(len(played), 1)


def measure(model, tokenizer, recipe: Recipe, held_out: Sequence[dict], seed: int) -> dict[str, float]:
    """Greedy held-out success, and temperature-1 success over ``SAMPLE_ROUNDS`` episodes per record."""
    greedy = play(model, tokenizer, recipe, held_out)
    sampled = play(model, tokenizer, recipe, list(held_out) * SAMPLE_ROUNDS, temperature=1.0, seed=seed)
    return {"eval_success": success_rate(greedy), "sample_success": success_rate(sampled)}


# ----------------------------------------------------------------------------------- the recipe


def build(recipe_name: str, seed: int, log: Callable[[str], Any] = print):
    """``(model, tokenizer, recipe record)``: the named recipe's warmed-up model, deterministic for a seed."""
    import torch

    recipe = RECIPES[recipe_name]
    torch.manual_seed(seed)
    started = time.monotonic()
    train, held_out = recipe.splits()
    tokenizer = build_tokenizer(MAX_POSITIONS)
    model = build_model(tokenizer, seed, MAX_POSITIONS)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    log(f"demo model: {recipe.name} SFT warm-up of a {params:.2f}M-param Llama")
    loss = sft_warmup(model, tokenizer, recipe, train, seed, log)
    sft_seconds = time.monotonic() - started
    scores = measure(model.eval(), tokenizer, recipe, held_out, seed)
    log(
        f"demo model: {recipe.sft_steps} SFT steps in {sft_seconds:.1f}s, held-out greedy success "
        f"{scores['eval_success']:.3f}, temperature-1 success {scores['sample_success']:.3f}"
    )
    record = {
        "recipe": recipe.name,
        "seed": seed,
        "sft_steps": recipe.sft_steps,
        "sft_right_fraction": recipe.right_fraction,
        "sft_final_loss": round(loss, 4),
        "sft_seconds": round(sft_seconds, 1),
        "eval_reward": scores["eval_success"],
        "sample_reward": scores["sample_success"],
        "eval_records": len(held_out),
    }
    return model, tokenizer, record

"""The demo policy: a byte-level tokenizer and a tiny Llama warmed up on a demo task (``demo-sort`` here;
the agentic ``demo-calc`` and ``demo-guess`` in ``asyncrl.demo.warmup``).

Invariants:
- Tokenization is one token per byte and adds NO special tokens (no BOS): ``encode(text)`` gives
  the same ids with or without ``add_special_tokens``, so HF, vLLM and the learner always agree.
  Responses end with ``</s>``; ``decode(..., skip_special_tokens=True)`` inverts ``encode``.
- ``prepare_demo_model`` is deterministic for a seed and publishes its directory atomically: a
  directory at ``path`` that holds ``asyncrl_recipe.json`` is complete, and is reused as a cache.

torch and transformers are imported inside functions so ``import asyncrl`` stays light.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.demo import sort

RECIPE = "demo-sort"
MOE_RECIPE = "demo-sort-moe"  # the same task and warm-up on a mixture of experts (build_moe_model)
RECIPE_FILE = "asyncrl_recipe.json"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
MAX_POSITIONS = 64  # longest prompt (12) + max_new_tokens (<= 16) + slack; vLLM reads this as max_model_len

# SFT warm-up: sorting with a systematic bug, trained to convergence. With probability
# SFT_SORTED_FRACTION the target is the sorted answer, otherwise the sorted answer WITHOUT its
# smallest letter. Why: a policy stopped early in plain SFT samples near-noise at temperature 1, so
# GRPO finds nothing to amplify (greedy reward fell in the probe); other "wrong modes" (echo,
# descending) are harder for 2 layers to learn than sorting, and RL damaged their sorted mode.
# Dropping the smallest letter changes only the first answer token, so both modes share one
# learned skill: greedy decoding takes the buggy mode (held-out reward ~0.2; the demo needs <= 0.4)
# while ~30% of temperature-1 samples are exactly right, the signal GRPO amplifies.
SFT_SORTED_FRACTION = 0.3
SFT_STEPS = 200
SFT_BATCH = 64
SFT_LR = 1e-3


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer(max_positions: int = MAX_POSITIONS):
    """Byte-level tokenizer: ids 0-255 are bytes, 256-258 are <pad>, <s>, </s>. No download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, model_max_length=max_positions
    )


def tiny_llama_config(tokenizer, max_positions: int) -> dict:
    """The demo models' shared shape: 2 layers of width 128 (MLP 384), 4 heads of 32 (vLLM's CPU attention
    refuses 16), the byte tokenizer's ids, float32, untied head."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_model(tokenizer, seed: int = 0, max_positions: int = MAX_POSITIONS):
    """A fresh tiny Llama (:func:`tiny_llama_config`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**tiny_llama_config(tokenizer, max_positions))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def build_moe_model(tokenizer, seed: int = 0, max_positions: int = MAX_POSITIONS):
    """A fresh tiny Qwen3-MoE, the dense demo's size with each MLP split into 8 experts of which every token
    takes 2 (in both layers); float32, untied head. An expert is 64 wide: vLLM's CPU MoE kernel pads widths to
    a multiple of 32 and then refuses weight updates of any other."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **tiny_llama_config(tokenizer, max_positions),  # its intermediate_size unused: every layer is sparse
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def sample_tokens(
    model, prompt_ids, max_new_tokens: int, eos_id: int, pad_id: int, temperature: float = 0.0, generator=None
):
    """Decode continuations of equal-length prompts ``(B, P)``; temperature 0 is greedy.

    Returns ``(tokens, logprobs, mask)``, each ``(B, T)``: sampled ids (pad after the first EOS),
    log pi(token) under the temperature-scaled distribution, and 1.0 on real tokens incl. EOS.
    """
    import torch

    batch, device = prompt_ids.shape[0], prompt_ids.device
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, logprobs, masks = [], [], []
    past, step_ids = None, prompt_ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                nxt = logits.argmax(dim=-1)
            live = ~done
            tokens.append(torch.where(live, nxt, torch.full_like(nxt, pad_id)))
            logprobs.append(torch.where(live, logp.gather(1, nxt[:, None]).squeeze(1), 0.0))
            masks.append(live.float())
            done = done | (nxt == eos_id)
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(masks, 1)


def decode_completions(tokenizer, tokens) -> list[str]:
    """Response text with special tokens stripped (what reward functions receive)."""
    return tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)


def _by_prompt_length(tokenizer, records: Sequence[dict]) -> dict[int, list[int]]:
    """Record indices grouped by prompt length, so batches need no padding (no position-id care)."""
    groups: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(len(tokenizer.encode(rec["prompt"])), []).append(i)
    return groups


def greedy_eval(model, tokenizer, records: Sequence[dict], max_new_tokens: int = 16) -> dict[str, float]:
    """Greedy decoding on ``records``: ``{"reward_mean", "exact_rate"}`` under the sort task."""
    import torch

    was_training = model.training
    model.eval()
    rewards, exacts = [0.0] * len(records), [False] * len(records)
    for idx in _by_prompt_length(tokenizer, records).values():
        ids = torch.tensor([tokenizer.encode(records[i]["prompt"]) for i in idx], device=model.device)
        tokens, _, _ = sample_tokens(model, ids, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
        for i, text in zip(idx, decode_completions(tokenizer, tokens), strict=True):
            rewards[i] = sort.reward(records[i]["prompt"], text, records[i])
            exacts[i] = sort.exact(text, records[i])
    model.train(was_training)
    n = max(len(records), 1)
    return {"reward_mean": sum(rewards) / n, "exact_rate": sum(exacts) / n}


def _sft_batch(tokenizer, records: Sequence[dict]):
    """Right-padded ``prompt + answer + </s>`` with labels only on answer and EOS (-100 elsewhere)."""
    prompts = [tokenizer.encode(rec["prompt"]) for rec in records]
    return pad_sft(tokenizer, prompts, [tokenizer.encode(rec["answer"]) + [tokenizer.eos_token_id] for rec in records])


def pad_sft(tokenizer, prompts: Sequence[list[int]], answers: Sequence[list[int]]):
    """``(input_ids, attention_mask, labels)``: each ``prompt + answer`` right-padded, labels on the answer only."""
    import torch

    rows = [p + a for p, a in zip(prompts, answers, strict=True)]
    labels = [[-100] * len(p) + a for p, a in zip(prompts, answers, strict=True)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)], lab[i, : len(lb)], att[i, : len(r)] = torch.tensor(r), torch.tensor(lb), 1
    return ids, att, lab


def sft_warmup(
    model,
    tokenizer,
    train: Sequence[dict],
    seed: int,
    log: Callable[[str], Any] = print,
    steps: int = SFT_STEPS,
    sorted_fraction: float = SFT_SORTED_FRACTION,
) -> float:
    """Supervised warm-up on the sorted / smallest-letter-dropped mixture; returns the last loss."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    for step in range(1, steps + 1):
        batch = [
            rec if rng.random() < sorted_fraction else {**rec, "answer": rec["answer"][1:]}
            for rec in rng.sample(train, SFT_BATCH)
        ]
        ids, att, lab = _sft_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps:
            log(f"sft step {step}/{steps}: loss {loss.item():.3f}")
    return loss.item()


def build_sort(seed: int, log: Callable[[str], Any], recipe: str = RECIPE):
    """The sort demo's model (``recipe`` demo-sort: a Llama; demo-sort-moe: a Qwen3-MoE), warmed up."""
    import torch

    torch.manual_seed(seed)
    started = time.monotonic()
    train, held_out = sort.make_splits(sort.N_TRAIN, sort.N_EVAL, sort.DATA_SEED)
    tokenizer = build_tokenizer()
    model = (build_moe_model if recipe == MOE_RECIPE else build_model)(tokenizer, seed)
    kind = type(model).__name__.removesuffix("ForCausalLM")
    log(f"demo model: SFT warm-up of a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-param {kind}")
    sft_warmup(model, tokenizer, train, seed, log)
    scores = greedy_eval(model.eval(), tokenizer, held_out)
    seconds = time.monotonic() - started
    log(
        f"demo model: {SFT_STEPS} SFT steps in {seconds:.1f}s, held-out greedy "
        f"reward {scores['reward_mean']:.3f} exact {scores['exact_rate']:.3f}"
    )
    record = {
        "recipe": recipe,
        "seed": seed,
        "sft_steps": SFT_STEPS,
        "sft_sorted_fraction": SFT_SORTED_FRACTION,
        "sft_seconds": round(seconds, 1),
        "eval_reward": scores["reward_mean"],
        "eval_exact": scores["exact_rate"],
        "eval_records": len(held_out),
    }
    return model, tokenizer, record

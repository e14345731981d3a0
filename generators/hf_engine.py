"""transformers ``generate`` engine, for machines where vLLM cannot run and for fast tests.
Weights change only between calls (``on_weight_update`` is always wait)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import ModelConfig
from asyncrl.generators.engine import Completion, Engine, Sampling


class HfEngine(Engine):
    def __init__(self, model: ModelConfig, seed: int):
        self.dtype = getattr(torch, model.dtype)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=self.dtype).eval().to(self.device)
        self.max_model_len = int(self.model.config.max_position_embeddings)
        tok = AutoTokenizer.from_pretrained(model.path)
        self.pad_id = tok.pad_token_id
        self.eos_id = tok.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, version: int = 0) -> list[list[Completion]]:
        flat = [p for p in prompts for _ in range(sampling.n)]
        width = max(len(p) for p in flat)
        # left-pad so every row continues at the same position
        ids = torch.full((len(flat), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(flat):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        done = torch.zeros(len(flat), dtype=torch.bool, device=self.device)
        out_tokens: list[list[int]] = [[] for _ in flat]
        out_lps: list[list[float]] = [[] for _ in flat]
        past = None
        step_ids = ids
        for _ in range(sampling.max_new_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            res = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos, past_key_values=past)
            past = res.past_key_values
            logits = res.logits[:, -1].float()
            if sampling.temperature == 0:
                nxt = logits.argmax(-1)
                lp = torch.log_softmax(logits, -1)
            else:
                lp = torch.log_softmax(logits / sampling.temperature, -1)
                nxt = torch.multinomial(lp.exp().cpu(), 1, generator=self.generator)[:, 0].to(self.device)
            for i in torch.nonzero(~done)[:, 0].tolist():
                out_tokens[i].append(int(nxt[i]))
                out_lps[i].append(float(lp[i, nxt[i]]))
            done |= nxt == self.eos_id
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            attn = torch.cat([attn, torch.ones_like(step_ids)], dim=1)
        comps = [
            Completion(t, lp, "stop" if t and t[-1] == self.eos_id else "length", [version] * len(t))
            for t, lp in zip(out_tokens, out_lps, strict=True)
        ]
        return [comps[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k: v.to(self.device, self.dtype) for k, v in tensors.items()})

"""transformers ``generate`` engine, for machines where vLLM cannot run and for fast tests.

Its request interface is coarse: one ``step`` runs every added request to completion (batched per
sampling setting, a request's ``sampling.n`` samples as rows of that batch), so weights can change only
between whole turns."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.chat import Completion, stop_at
from asyncrl.config import ModelConfig
from asyncrl.errors import UserError
from asyncrl.generators.engine import Engine, Sampling, StepOutput, context_length
from asyncrl.models.routers import RouterTap, choices_of
from asyncrl.weights.ties import module_aliases


class HfEngine(Engine):
    multi_sample = True

    def __init__(self, model: ModelConfig, seed: int, max_model_len: int | None = None):
        self.dtype = getattr(torch, model.dtype)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=self.dtype).eval().to(self.device)
        self.max_model_len = context_length(model.path, max_model_len)
        self.tied = module_aliases(self.model)  # published once: see asyncrl.weights.ties
        self.tok = tok = AutoTokenizer.from_pretrained(model.path)
        self.pad_id = tok.pad_token_id
        self.eos_id = tok.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self._requests: dict[str, tuple[list[int], Sampling]] = {}
        self.routers = RouterTap(self.model)  # a mixture of experts: the probe's expert choices

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, version: int = 0) -> list[list[Completion]]:
        flat = [p for p in prompts for _ in range(sampling.n)]
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=self.device)
        width = max(len(p) for p in flat)
        # left-pad so every row continues at the same position
        ids = torch.full((len(flat), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(flat):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        done = torch.zeros(len(flat), dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(done)  # by a stop string
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
                lp = processed_logprobs(logits, sampling)
                nxt = torch.multinomial(lp.exp().cpu(), 1, generator=self.generator)[:, 0].to(self.device)
            for i in torch.nonzero(~done)[:, 0].tolist():
                out_tokens[i].append(int(nxt[i]))
                out_lps[i].append(float(lp[i, nxt[i]]))
                if sampling.stop and stop_at(self.tok.decode(out_tokens[i], skip_special_tokens=True), sampling.stop):
                    stopped[i] = True
            done |= (nxt == self.eos_id) | torch.isin(nxt, stop_ids) | stopped
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            attn = torch.cat([attn, torch.ones_like(step_ids)], dim=1)
        stops = set(sampling.stop_token_ids)
        comps = [
            Completion(
                t,
                lp,
                "stop" if t and (t[-1] == self.eos_id or t[-1] in stops or bool(hit)) else "length",
                [version] * len(t),
            )
            for t, lp, hit in zip(out_tokens, out_lps, stopped.tolist(), strict=True)
        ]
        return [comps[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every weight of the model; a tied one (the LM head of tied embeddings) comes once, under the
        name it is tied to, and the model's own tie gives it to both."""
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.device, self.dtype) for k, v in tensors.items()}, strict=False
        )
        if unexpected or set(missing) != self.tied.keys() - tensors.keys():
            raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")

    @torch.no_grad()
    def score(self, ids: list[int]) -> list[float]:
        x = torch.tensor([ids], device=self.device)
        with self.routers:
            logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)
        self.probe_routing = choices_of(self.routers)
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    def add_request(self, request_id: str, prompt: list[int], sampling: Sampling, images: tuple = ()) -> None:
        if images:  # preflight refuses a vision-language model on this engine; this is the engine's own guard
            raise UserError("the transformers engine serves text models only: use generator.engine.type=vllm")
        self._requests[request_id] = (prompt, sampling)

    def step(self) -> list[StepOutput]:
        batches: dict[Sampling, list[tuple[str, list[int]]]] = {}
        for rid, (prompt, sampling) in self._requests.items():
            batches.setdefault(sampling, []).append((rid, prompt))
        self._requests = {}
        outs = []
        for sampling, reqs in batches.items():
            comps = self.generate([p for _, p in reqs], sampling)
            outs += [
                StepOutput(rid, c.tokens, c.logprobs, True, c.finish_reason, i)
                for (rid, _), samples in zip(reqs, comps, strict=True)
                for i, c in enumerate(samples)
            ]
        return outs

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probs of the distribution sampled, as vLLM's ``processed_logprobs``: temperature, then
    ``min_p``, then ``top_k`` and ``top_p``, the dropped tokens at -inf and the rest renormalised."""
    logits = logits / sampling.temperature
    if sampling.min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = torch.softmax(ordered, -1).cumsum(-1) - torch.softmax(ordered, -1)  # mass ahead of each
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, -1)

"""A trained reward model (an ``asyncrl rm`` export) as a run's reward: ``data.reward: rm:<export dir>``.

Loaded in each generator process at its first call. Calls from concurrent episodes are scored together:
while one forward runs (on a worker thread, so the event loop goes on sampling) the next calls wait in
one batch, which is scored as soon as the forward before it ends, up to ``MAX_BATCH`` at a time. The
score is the model's scalar on the record's prompt, rendered as ``asyncrl rm`` rendered it (the
export's chat settings), followed by the completion and the token that ends the model's turn.
Throughput: ``reward_model/scored``, ``reward_model/forwards`` and ``reward_model/samples_per_s``
(samples over the seconds the forwards took) in each generator's metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from asyncrl.errors import UserError

PREFIX = "rm:"
REWARD_HEAD = "reward_head.safetensors"  # the scalar head, next to the base model's files
SETTINGS = "asyncrl_reward_model.json"  # how the examples' prompts were rendered in training
MAX_BATCH = 64


def check_export(path: Path) -> Path:
    """``path`` if it holds an ``asyncrl rm`` export, else a UserError saying what is missing."""
    for name in ("config.json", REWARD_HEAD):
        if not (path / name).is_file():
            raise UserError(f"data.reward={PREFIX}{path}: not an asyncrl rm export (no {name}; see docs/offline.md)")
    return path


class RewardModelReward:
    """``await reward(prompt, completion, record)`` -> the reward model's score (a float)."""

    def __init__(self, path: str | Path):
        self.path = check_export(Path(path))
        self._load_lock = threading.Lock()
        self._model = None
        self._pending: list[tuple[tuple[list[int], list[int]], asyncio.Future]] = []
        self._scoring: asyncio.Task | None = None
        self.scored, self.forwards, self.seconds = 0, 0, 0.0

    def _load(self) -> None:
        with self._load_lock:
            if self._model is not None:
                return
            import torch
            from safetensors.torch import load_file
            from transformers import AutoModel, AutoTokenizer

            from asyncrl.chat import ChatTokens
            from asyncrl.models.reward_head import RewardModel

            settings = json.loads((self.path / SETTINGS).read_text()) if (self.path / SETTINGS).is_file() else {}
            tok = AutoTokenizer.from_pretrained(self.path)
            self.chat = ChatTokens(
                tok, use_template=settings.get("chat_template", True), system_prompt=settings.get("system_prompt")
            )
            base = AutoModel.from_pretrained(self.path, dtype=torch.float32)
            model = RewardModel(base, base.config.hidden_size)
            model.head.load_state_dict(load_file(self.path / REWARD_HEAD))
            self._model = model.eval().requires_grad_(False)

    async def __call__(self, prompt: str, completion: str, record: dict) -> float:
        del prompt  # rendered as in training, from the record's own prompt
        if self._model is None:
            await asyncio.to_thread(self._load)
        from asyncrl.data import prompt_of

        future = asyncio.get_running_loop().create_future()
        self._pending.append(((self.chat.prompt_ids(prompt_of(record)), self.chat.response_ids(completion)), future))
        if self._scoring is None or self._scoring.done():
            self._scoring = asyncio.create_task(self._score_pending())
        return await future

    async def _score_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                scores = await asyncio.to_thread(self._forward, [seq for seq, _ in batch])
            except Exception as exc:  # noqa: BLE001 - each waiting episode gets the error as its reward's
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), score in zip(batch, scores, strict=True):
                if not future.done():  # its episode may have timed out meanwhile
                    future.set_result(score)

    def _forward(self, sequences: list[tuple[list[int], list[int]]]) -> list[float]:
        import torch

        from asyncrl.models.reward_head import pad_pairs

        start = time.perf_counter()
        batch = pad_pairs(sequences, self.chat.pad_id)
        with torch.no_grad():
            scores = self._model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        self.scored += len(sequences)
        self.forwards += 1
        self.seconds += time.perf_counter() - start
        return [float(s) for s in scores]

    def metrics(self) -> dict[str, float]:
        rate = self.scored / self.seconds if self.seconds else 0.0
        return {
            "reward_model/scored": self.scored,
            "reward_model/forwards": self.forwards,
            "reward_model/samples_per_s": rate,
        }

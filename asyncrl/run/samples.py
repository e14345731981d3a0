"""What the model sees and writes: ``runs/<name>/samples.jsonl``, and the prompts ``asyncrl launch --dry-run
--show-prompts N`` prints.

Generators send the first few episodes of every evaluation, and of a training group every few versions,
as metrics records with ``samples/items`` (``asyncrl.generators.evaluation``). The launcher, the only
writer of the run directory, appends one JSON line per completion to ``samples.jsonl``: ``kind`` (eval or
train), ``version`` (the weights that sampled it), ``point`` (the eval or sample point it stands for),
``generator``, ``prompt`` and ``completion`` (decoded from the token ids, special tokens kept), ``reward``
(null for a failed episode, with ``failed``: its cause), ``finish_reason``. Past ``MAX_BYTES`` the file
becomes ``samples.jsonl.1`` (replacing the one before) and a new one starts: the two hold the newest
lines, at most twice that. A resumed run appends to them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.generators.evaluation import cut
from asyncrl.observe.metrics import JsonlSink

SAMPLES_FILE = "samples.jsonl"
ITEMS_FIELD = "samples/items"  # the field that makes a metrics record a samples record
MAX_BYTES = 1 << 20  # per file: thousands of the demo's lines, a few hundred of a long-context run's


def sample_lines(record: dict) -> list[dict]:
    """The lines of one samples record, one per completion; TypeError for a record of the wrong shape
    (counted and skipped like any bad metrics record)."""
    items = record[ITEMS_FIELD]
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise TypeError(f"{ITEMS_FIELD} must be a list of objects")
    head = {k: record.get(f"samples/{k}") for k in ("kind", "version", "point")}
    head = {"time": record.get("time"), **head, "generator": str(record.get("source", "")).removeprefix("generator/")}
    # texts cut here too: a generator of another version, joined from elsewhere, may send longer ones
    return [{**head, **{k: cut(v) if isinstance(v, str) else v for k, v in item.items()}} for item in items]


class SamplesLog:
    def __init__(self, run_dir: Path, max_bytes: int = MAX_BYTES):
        self.path = Path(run_dir) / SAMPLES_FILE
        self.max_bytes = max_bytes
        self._sink: JsonlSink | None = None  # opened at the first line: a run without samples has no file

    def log(self, lines: list[dict]) -> None:
        """Append ``lines`` (:func:`sample_lines`); raises ``DiskFull`` like metrics.jsonl."""
        for line in lines:
            self._append(line)

    def _append(self, line: dict) -> None:
        if self._sink is None:
            self._sink = JsonlSink(self.path)
        size = len(json.dumps(line)) + 1
        if self._sink.size() and self._sink.size() + size > self.max_bytes:
            self._sink.close()
            self.path.replace(self.path.with_name(SAMPLES_FILE + ".1"))
            self._sink = JsonlSink(self.path)
        self._sink.log(line)

    def close(self) -> None:
        if self._sink is not None:
            with contextlib.suppress(OSError):
                self._sink.close()
            self._sink = None


def show_prompts(cfg: Config, n: int) -> str:
    """The run's first ``n`` prompts in the order generators claim them, as the model sees them: the chat
    template applied (``episode.chat_template``, ``episode.system_prompt``), decoded from the token ids."""
    from transformers import AutoTokenizer

    from asyncrl.chat import ChatTokens
    from asyncrl.data import prompt_of
    from asyncrl.data.sources import open_train

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--show-prompts needs the tokenizer at model.path {cfg.model.path}: {exc}") from None
    chat = ChatTokens(tokenizer, use_template=cfg.episode.chat_template, system_prompt=cfg.episode.system_prompt)
    train = open_train(cfg)
    out = []
    for seq in range(n):
        source, _, idx, record = train.record(seq)
        ids = chat.prompt_ids(prompt_of(record))
        out.append(f"--- prompt {seq + 1} of {n} ({train.sets[source].where(idx)}, {len(ids)} tokens)\n")
        out.append(tokenizer.decode(ids) + "\n")
    return "".join(out)

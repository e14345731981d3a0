"""Where a run's prompts come from, and the order groups draw them in.

A source (:class:`asyncrl.config.data.SourceConfig`) is a JSONL file, read line by line as always, or what the
``datasets`` library reads: a Parquet, Arrow, JSON or CSV file, a glob of such shards, or a directory that
``Dataset.save_to_disk`` wrote. Those are read as memory-mapped Arrow (``datasets`` converts Parquet, JSON and
CSV once into its cache; the launcher's preflight does it before any child starts), so a process holds the rows
it reads, not the dataset.

A source's rows become records, the dicts that generators prompt with and rewards receive: ``columns`` maps a
record field to a column (``{prompt: question}``: the record's ``prompt`` is the ``question`` column), every
other column keeps its name, and ``template`` makes the prompt from the record's fields. A record then has a
``prompt`` string or chat ``messages`` (:func:`asyncrl.data.prompt_of`). A JSONL file is checked line by line
when it is opened; an Arrow source by its schema (the prompt's column exists, is a string or a chat, has no
nulls) and its first row, so that opening five million rows costs what opening a thousand does.

Several sources make a mixture (:class:`Mixture`): group ``seq``, the buffer's cursor, is drawn from source s
with its weight's share, apportioned per block of :data:`BLOCK` groups and spread through the block by smooth
weighted round-robin (any run of groups holds the shares to within a group or so); within a source, an
epoch-by-epoch seeded permutation, as one file's order always was. All of it is a function of
``seq`` and the seed, so a resumed run goes on with exactly the prompts an uninterrupted one would have drawn.
"""

from __future__ import annotations

import functools
import glob
import os
from pathlib import Path

import numpy as np

from asyncrl.config.data import SourceConfig
from asyncrl.data import numbered_jsonl, prompt_for_sequence, record_problem
from asyncrl.data.procedural import ProceduralRows, is_procedural
from asyncrl.errors import UserError

BLOCK = 1024  # a mixture's groups are apportioned to its sources per block of this many
# rows per record batch of the Arrow cache that `datasets` converts into: opening the cache reads every batch's
# header, and with `datasets`' default of 1,000 rows those headers sit every few KB, so the kernel's fault-around
# pages in the whole file (92 MB of 5 million short prompts) at the open; 100,000 rows leave 50 headers. (The
# Parquet reader's batch size is in the cache's fingerprint, the writer's is not: both are set.)
WRITER_BATCH = 100_000
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}  # `datasets`' readers


class PromptSet:
    """One source's records, read by index: ``len``, ``[i]`` (the mapped record), :meth:`where`."""

    def __init__(self, source: SourceConfig):
        self.source, self.name = source, source.path
        path = Path(source.path)
        self.base_dir = path if path.is_dir() else path.parent  # a record's image paths are relative to it
        self.columns = dict(source.columns)
        if source.path.endswith(".jsonl"):
            numbered = numbered_jsonl(source.path, lambda rec: self._problem(rec))
            if not numbered:
                raise UserError(f"dataset file is empty: {source.path}")
            self._lines, self._rows = zip(*numbered, strict=True)
        elif is_procedural(source.path):
            self._lines, self._rows = None, ProceduralRows(source.path, source.size, source.seed, source.options)
            if not {"prompt", "messages"} & set(self.columns) and source.template is None:
                self.columns["prompt"] = "question"  # a task's prompt is its question, unless mapped otherwise
            if wrong := self._problem(self._rows[0]):
                raise UserError(f"{self.name} row 0: {wrong}")
        else:
            self._lines, self._rows = None, open_arrow(source)
            self._check_arrow()

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def is_jsonl(self) -> bool:
        return self._lines is not None

    def __getitem__(self, index: int) -> dict:
        return self._mapped(self._rows[index])

    def head(self, n: int) -> list[dict]:
        """The first ``n`` records (all, if fewer)."""
        return [self[i] for i in range(min(n, len(self)))]

    def where(self, index: int) -> str:
        """Where record ``index`` is, for messages: ``file:line`` or ``source row n``."""
        return f"{self.name}:{self._lines[index]}" if self._lines is not None else f"{self.name} row {index}"

    @property
    def has_images(self) -> bool:
        if self._lines is not None:
            return any(rec.get("images") for rec in self._rows)
        return "images" in self._rows.column_names or "images" in self.columns

    def _mapped(self, row: dict) -> dict:
        """The record a row makes: the mapped fields, then the template's prompt."""
        columns, template = self.columns, self.source.template
        if not columns and template is None:
            return row
        record = {**row, **{field: row[column] for field, column in columns.items()}}
        if template is not None:
            record["prompt"] = template.format_map(record)
        if "prompt" in columns or template is not None:
            record.pop("messages", None)
        elif "messages" in columns:
            record.pop("prompt", None)
        return record

    def _problem(self, row: object) -> str | None:
        """What is wrong with one JSONL line, as a record (after the mapping), or None."""
        if not isinstance(row, dict):
            return "each line must be a JSON object"
        if missing := self._missing(set(row)):
            return missing
        try:
            return record_problem(self._mapped(row))
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            return f"the template cannot be filled: {type(exc).__name__}: {exc}"

    def _missing(self, have: set[str]) -> str | None:
        """The first mapped column or template field that ``have`` lacks, as a message, or None."""
        for field, column in self.columns.items():
            if column not in have:
                return f"no column {column!r} (columns.{field}); the columns are {', '.join(sorted(have))}"
        fields = have | set(self.columns)
        for name in self.source.template_fields:
            if name not in fields:
                return f"the template names {{{name}}}, which is no column; the columns are {', '.join(sorted(have))}"
        return None

    def _check_arrow(self) -> None:
        """The schema says each record will have a prompt; the first row is checked as a JSONL line would be."""
        ds, columns = self._rows, self.columns
        if len(ds) == 0:
            raise UserError(f"{self.name}: the source has no rows")
        if missing := self._missing(set(ds.column_names)):
            raise UserError(f"{self.name}: {missing}")
        if self.source.template is not None:
            needed = [columns.get(f, f) for f in self.source.template_fields]
        else:
            field = next((f for f in ("prompt", "messages") if f in columns or f in ds.column_names), None)
            if field is None:
                raise UserError(
                    f"{self.name}: no 'prompt' or 'messages' column; map one (columns: {{prompt: <column>}}) or give a "
                    f"template; the columns are {', '.join(sorted(ds.column_names))}"
                )
            needed = [columns.get(field, field)]
            kind = ds.features[needed[0]]
            if field == "prompt" and getattr(kind, "dtype", None) not in ("string", "large_string"):
                raise UserError(f"{self.name}: column {needed[0]!r} (the prompt) holds {kind}, not strings")
            if field == "messages" and not isinstance(kind, list | _sequence()):
                raise UserError(f"{self.name}: column {needed[0]!r} (the messages) holds {kind}, not chat messages")
        table = ds.data
        for column in needed:
            if nulls := table.column(column).null_count:
                raise UserError(f"{self.name}: column {column!r} has {nulls} empty (null) values")
        if wrong := self._problem(ds[0]):
            raise UserError(f"{self.name} row 0: {wrong}")


def _sequence():
    from datasets import Sequence

    return Sequence


def shards(source: SourceConfig) -> list[str]:
    """The files a file or glob source names, sorted; ``UserError`` for none, or an empty or corrupt one."""
    path = source.path
    files = sorted(glob.glob(path)) if glob.has_magic(path) else ([path] if Path(path).is_file() else [])
    if not files:
        raise UserError(f"{path}: " + ("the glob matches no file" if glob.has_magic(path) else "no such file"))
    kinds = {Path(f).suffix for f in files}
    if len(kinds) > 1 or not kinds <= set(BUILDERS):
        raise UserError(f"{path}: shards must all be one of {', '.join(BUILDERS)} (.jsonl: one file), not {kinds}")
    for file in files:
        if os.path.getsize(file) == 0:
            raise UserError(f"{path}: shard {file} is empty")
        if file.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(file).metadata.num_rows
            except (pa.ArrowException, OSError) as exc:
                raise UserError(f"{path}: shard {file} is not a readable Parquet file ({exc})") from None
            if rows == 0:
                raise UserError(f"{path}: shard {file} has no rows")
    return files


def open_arrow(source: SourceConfig):
    """The source as a memory-mapped ``datasets.Dataset``; ``UserError`` naming it for anything unreadable."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source.path)
    try:
        if path.is_dir():
            return _from_disk(source, datasets)
        files = shards(source)
        builder = BUILDERS[Path(files[0]).suffix]
        batches = {"writer_batch_size": WRITER_BATCH} | ({"batch_size": WRITER_BATCH} if builder == "parquet" else {})
        return datasets.load_dataset(builder, data_files=files, split="train", **batches)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever `datasets` or Arrow raise on a bad file is the source's fault
        raise UserError(f"{source.path}: cannot be read as a dataset: {type(exc).__name__}: {exc}") from None


def _from_disk(source: SourceConfig, datasets):
    if not any((Path(source.path) / f).is_file() for f in ("state.json", "dataset_dict.json")):
        raise UserError(
            f"{source.path}: a directory that `datasets`' save_to_disk did not write; name its files with a glob "
            f"(e.g. {source.path}/*.parquet)"
        )
    loaded = datasets.load_from_disk(source.path)
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise UserError(f"{source.path}: no split {source.split!r}; its splits are {', '.join(loaded)}")
        loaded = loaded[source.split]
    return loaded


class Mixture:
    """The run's train sources and the order groups draw from them (the module's doc)."""

    def __init__(self, sets: list[PromptSet], seed: int):
        self.sets, self.seed = sets, seed
        self.counts = apportion([s.source.weight for s in sets], BLOCK)  # one source: every group, its file's order
        if (self.counts == 0).any():
            small = sets[int(np.argmin(self.counts))].name
            raise UserError(f"{small}: its weight is below one group in {BLOCK}; raise it or leave the source out")

    def pick(self, seq: int) -> tuple[int, int, int]:
        """Group ``seq`` -> (source, epoch, index within that source)."""
        block, pos = divmod(seq, BLOCK)
        order, rank = _block_order(tuple(int(c) for c in self.counts))
        source = int(order[pos])
        nth = block * int(self.counts[source]) + int(rank[pos])  # the source's own cursor
        epoch, index = prompt_for_sequence(nth, len(self.sets[source]), self.seed, stream=source)
        return source, epoch, index

    def record(self, seq: int) -> tuple[int, int, int, dict]:
        """Group ``seq`` -> (source, epoch, index, the record)."""
        source, epoch, index = self.pick(seq)
        return source, epoch, index, self.sets[source][index]


def apportion(weights: list[float], total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights`` by largest remainders (ties to the earlier source)."""
    share = np.asarray(weights, np.float64) / sum(weights) * total
    counts = np.floor(share).astype(np.int64)
    left = total - int(counts.sum())
    order = sorted(range(len(weights)), key=lambda i: (-(share[i] - counts[i]), i))
    counts[order[:left]] += 1
    return counts


@functools.lru_cache(maxsize=8)
def _block_order(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A block's sources in draw order, and each position's rank among its source's draws there: smooth
    weighted round-robin, so every prefix of a block holds each source's share to within a group or so."""
    total, current = sum(counts), np.zeros(len(counts), np.int64)
    order, rank, drawn = np.empty(total, np.int64), np.empty(total, np.int64), np.zeros(len(counts), np.int64)
    for pos in range(total):
        current += counts
        source = int(np.argmax(current))
        current[source] -= total
        order[pos], rank[pos] = source, drawn[source]
        drawn[source] += 1
    return order, rank


def open_train(cfg) -> Mixture:
    """The run's ``data.train`` sources, opened and checked."""
    return Mixture([PromptSet(s) for s in cfg.data.train_sources], cfg.run.seed)


def open_evals(cfg) -> list[PromptSet]:
    """The run's eval sets (``data.eval_sets``: the bar's first), opened and checked."""
    return [PromptSet(s) for s in cfg.data.eval_sets]

"""``data``: the prompts, the held-out prompts and the reward that scores them. No defaults: a run names its
own (the demos' configs in ``configs/`` name theirs); the core knows no task.

A prompt source (``data.train``, ``data.eval``) is a path, or a :class:`SourceConfig` when its columns need
mapping; ``data.train`` may be a list of them with weights, a mixture (:mod:`asyncrl.data.sources`), and
``data.eval`` a list of named sets (:class:`EvalSetConfig`), each with its own reward, size and pass@k."""

from __future__ import annotations

import re
import string
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.config.base import Section

SOURCE_FORMS = (
    "a JSONL file, a Parquet, Arrow, JSON or CSV file, a glob of such shards, a directory that "
    "`datasets`' save_to_disk wrote, or reasoning_gym:<task>, a procedural task of reasoning-gym"
)


class SourceConfig(Section):
    path: str = Field(description=f"Where the records are: {SOURCE_FORMS}.")
    columns: dict[str, str] = Field(
        {},
        description="Record field -> the source's column, e.g. {prompt: question, label: answer}: the record's "
        "'prompt' is the question column. Every other column keeps its own name; the reward sees them all.",
    )
    template: str | None = Field(
        None,
        description="The prompt made from the record's fields, in Python format syntax, e.g. "
        "'{question}\\nAnswer with the number.' (none: the 'prompt' or 'messages' field).",
    )
    reward: str | None = Field(
        None,
        description="This source's own reward, in data.reward's forms (none: data.reward; data.eval: eval_reward).",
    )
    split: str = Field("train", description="The split to read from a save_to_disk directory of several splits.")
    size: int = Field(1000, ge=1, description="A reasoning_gym:<task> source: how many records it draws.")
    seed: int = Field(0, description="A reasoning_gym:<task> source: its seed (the held-out set's: another one).")
    options: dict[str, Any] = Field({}, description="A reasoning_gym:<task> source: the task's own options.")
    weight: float = Field(
        1.0, gt=0, description="In a data.train mixture: this source's share of the groups (data.eval: unused)."
    )

    @model_validator(mode="after")
    def _prompt_once(self) -> SourceConfig:
        named = [f"columns.{k}" for k in ("prompt", "messages") if k in self.columns] + (
            ["template"] * (self.template is not None)
        )
        if len(named) > 1:
            raise ValueError(
                f"source {self.path}: the prompt comes from one of columns.prompt, columns.messages or "
                f"template, not {' and '.join(named)}"
            )
        if self.template is not None:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
            except ValueError as exc:
                raise ValueError(f"source {self.path}: template is not a format string: {exc}") from None
            if not fields or any(f == "" or f.isdigit() for f in fields):
                raise ValueError(f"source {self.path}: template must name record fields, e.g. '{{question}}'")
        return self

    @property
    def template_fields(self) -> list[str]:
        """The record fields the template names (the part before any ``.`` or ``[``)."""
        if self.template is None:
            return []
        names = (f for _, f, _, _ in string.Formatter().parse(self.template) if f)
        return list(dict.fromkeys(f.split(".")[0].split("[")[0] for f in names))


def _form(value: object) -> str:
    """Which form a source is written in, so that a wrong one gets the errors of its own form only."""
    if isinstance(value, list | tuple):
        return "mixture"
    return "path" if isinstance(value, str) else "source"


# a source as written: a path, or a mapping of SourceConfig's fields; data.train may be a list of them
Source = Annotated[Annotated[str, Tag("path")] | Annotated[SourceConfig, Tag("source")], Discriminator(_form)]
Sources = Annotated[
    Annotated[str, Tag("path")] | Annotated[SourceConfig, Tag("source")] | Annotated[list[Source], Tag("mixture")],
    Discriminator(_form),
]


class EvalSetConfig(SourceConfig):
    """A named held-out set: a source, evaluated greedily, and at ``temperature`` ``k`` times a prompt when asked."""

    name: str = Field(
        description="A named set's (data.eval as a list): its metrics are eval/<name>/... (letters, digits, '_', "
        "'-', '.')."
    )
    size: int | None = Field(  # type: ignore[assignment]  # a SourceConfig's, with the held-out default
        None,
        ge=1,
        description="Prompts an evaluation of this set uses, its first ones (a reasoning_gym set draws this many); "
        "none: data.eval_size.",
    )
    k: int = Field(
        0,
        ge=0,
        description="Samples a prompt at `temperature`, besides the greedy one: mean@k (their mean reward) and "
        "pass@k (the share of prompts with one exactly right, reward >= 1) (0: greedy only).",
    )
    temperature: float = Field(1.0, gt=0, description="The k samples' temperature (top_p 1).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise ValueError("an eval set's name is letters, digits, '_', '-' and '.' (it names metrics)")
        return value


def _eval_form(value: object) -> str:
    return "sets" if isinstance(value, list | tuple) else _form(value)


Evals = Annotated[
    Annotated[str, Tag("path")] | Annotated[SourceConfig, Tag("source")] | Annotated[list[EvalSetConfig], Tag("sets")],
    Discriminator(_eval_form),
]


class DataConfig(Section):
    train: Sources | None = Field(
        None,
        description=f"The prompts: {SOURCE_FORMS} (records with a 'prompt' string or chat 'messages'); or a source "
        "with a column mapping; or a list of sources with weights, a mixture. A run must name them.",
    )
    eval: Evals | None = Field(
        None,
        description="Held-out prompts for greedy evaluation: one source, or a list of named sets (name, the "
        "source's fields, size, k and temperature for mean@k / pass@k) (none: no evaluation).",
    )
    eval_bar: str | None = Field(
        None,
        description="With named eval sets: the one whose greedy reward is the run's bar (eval/reward_mean, "
        "summary.json's final_eval_reward) (none: the first).",
    )
    reward: str | None = Field(
        None,
        description="Reward function as 'module:function', a reward server's http(s) URL, or rm:<dir>, a reward "
        "model that `asyncrl rm` exported (scored in batches in each generator); a run must name one.",
    )
    eval_reward: str | None = Field(
        None, description="Reward of the greedy held-out evaluation, in the same forms (none: data.reward)."
    )
    eval_size: int = Field(128, ge=1, description="Held-out prompts used per evaluation.")

    @field_validator("train")
    @classmethod
    def _some_source(cls, value: object) -> object:
        if isinstance(value, list) and not value:
            raise ValueError("data.train is an empty list: name at least one source")
        return value

    @model_validator(mode="after")
    def _named_sets(self) -> DataConfig:
        names = [s.name for s in self.eval] if isinstance(self.eval, list) else []
        if isinstance(self.eval, list) and not names:
            raise ValueError("data.eval is an empty list: name at least one set, or leave data.eval out")
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"data.eval: two sets are named {', '.join(dupes)}")
        if self.eval_bar is not None and self.eval_bar not in names:
            known = f"the sets are {', '.join(names)}" if names else "data.eval has no named sets"
            raise ValueError(f"data.eval_bar names no eval set ({known})")
        return self

    @property
    def train_sources(self) -> list[SourceConfig]:
        """``data.train`` as sources (none named: ``[]``)."""
        if self.train is None:
            return []
        return [self._source(s) for s in (self.train if isinstance(self.train, list) else [self.train])]

    @property
    def eval_sets(self) -> list[EvalSetConfig]:
        """``data.eval`` as sets, each with its size: named ones as written, the bar first; one source as one set
        named ``""`` (its metrics are ``eval/...``), of ``eval_size`` prompts (a reasoning_gym source's first)."""
        if self.eval is None:
            return []
        if isinstance(self.eval, list):
            sets = [s if s.size else s.model_copy(update={"size": self.eval_size}) for s in self.eval]
            bar = self.eval_bar or sets[0].name
            return sorted(sets, key=lambda s: s.name != bar)
        one = self._source(self.eval)
        size = min(one.size, self.eval_size) if one.path.startswith("reasoning_gym:") else self.eval_size
        return [EvalSetConfig.model_construct(**one.model_dump(exclude={"size"}), name="", size=size)]

    @property
    def eval_prompts(self) -> int:
        """Episodes an evaluation plays at most: each set's prompts, greedy and k times sampled."""
        return sum(s.size * (1 + s.k) for s in self.eval_sets)

    @property
    def reward_specs(self) -> tuple[list[str | None], list[str | None]]:
        """Each train source's reward, and each eval set's (None where the run names none)."""
        held_out = [s.reward or self.eval_reward or self.reward for s in self.eval_sets]
        return [s.reward or self.reward for s in self.train_sources], held_out

    @staticmethod
    def _source(value: str | SourceConfig) -> SourceConfig:
        return SourceConfig(path=value) if isinstance(value, str) else value

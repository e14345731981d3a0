"""The root ``Config``: the sections composed, read from YAML plus dotted overrides, checked across sections.

Config is resolved once by the launcher, written to ``runs/<name>/config.yaml`` and passed to every
child process as that file. It is never mutated at runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.base import Section
from asyncrl.config.buffer import BufferConfig, RedisBufferConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.episode import MEMBERS, CompletionEpisodeConfig, EpisodeConfig, retype
from asyncrl.config.generator import GeneratorConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.model import ModelConfig
from asyncrl.config.run import RunConfig
from asyncrl.config.weights import WeightsConfig, ZmqWeightsConfig
from asyncrl.errors import UserError


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    buffer: BufferConfig = Field(RedisBufferConfig(), description="Trajectory buffer.")
    generator: GeneratorConfig = GeneratorConfig()
    episode: EpisodeConfig = Field(
        CompletionEpisodeConfig(),
        description="What one sample is, by its type (left out: named by function, env_url, agent or agent_command).",
    )
    learner: LearnerConfig = LearnerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    weights: WeightsConfig = Field(ZmqWeightsConfig(), description="Weight bus from learner rank 0 to the generators.")

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.learner.groups_per_step % self.run.learners:
            raise ValueError(
                f"learner.groups_per_step ({self.learner.groups_per_step}) must be divisible by "
                f"run.learners ({self.run.learners})"
            )
        share = self.learner.groups_per_step // self.run.learners
        if share % self.learner.minibatches:
            raise ValueError(
                f"learner.groups_per_step / run.learners ({share}) must be divisible by "
                f"learner.minibatches ({self.learner.minibatches})"
            )
        if self.buffer.type == "memory" and (self.run.generators > 1 or self.run.learners > 1):
            raise ValueError("buffer.type=memory works only in one process; use redis")
        if self.weights.type == "memory" and (self.run.generators > 1 or self.run.learners > 1):
            raise ValueError("weights.type=memory works only in one process; use zmq (any host) or shm (one host)")
        if self.algorithm.routing_replay and self.generator.engine.type != "vllm":
            raise ValueError("algorithm.routing_replay needs generator.engine.type=vllm (its routers' capture)")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    @property
    def evaluates(self) -> bool:
        """Whether the generators evaluate the policy on held-out prompts (``generator.eval`` and ``data.eval``)."""
        return self.generator.eval and self.data.eval is not None


# Fields that moved when backends became typed sections: old dotted name -> new one. A config that
# still uses an old name gets one error naming the new one.
MOVED = {
    "buffer.redis_url": "buffer.url",
    "generator.kv_cache_gb": "generator.engine.kv_cache_gb",
    "generator.on_weight_update": "generator.engine.on_weight_update",
    "weights.transport": "weights.type",
    "generator.groups_in_flight": "generator.episodes_in_flight (groups x n_samples)",
    "weights.shm_dir": "weights.dir (with weights.type: shm)",
    "weights.shm_verify": "weights.verify (with weights.type: shm)",
    "weights.collective_timeout_s": "weights.timeout_s (with weights.type: nccl)",
}


def _check_moved(tree: dict) -> None:
    for old, new in MOVED.items():
        section, field = old.split(".")
        if isinstance(tree.get(section), dict) and field in tree[section]:
            raise UserError(f"invalid config: {old} is now {new}")
    engine = (tree.get("generator") or {}).get("engine") if isinstance(tree.get("generator"), dict) else None
    if isinstance(engine, str):
        raise UserError(f"invalid config: generator.engine is a section now: use generator.engine.type={engine}")


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted = 'a.b'``, creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"cannot set {dotted}: {key} is not a section")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'learner.lr=1e-5'`` -> ``('learner.lr', 1e-05)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"override {text!r} is not of the form section.field=value")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        try:  # YAML 1.1 reads '1e-5' (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None, text: str | None = None, schema=None
) -> Config:
    """Read YAML from ``path`` (or ``text``; else defaults), apply dotted overrides, validate against
    ``schema`` (default ``Config``; ``offline_config.OfflineConfig`` for sft/rm/dpo). Raises UserError
    naming the field."""
    tree: dict = {}
    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"config file not found: {path}")
        text = Path(path).read_text()
    if text is not None:
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise UserError(f"config file {where} is not valid YAML: {problem}") from None
        if not isinstance(tree, dict):
            raise UserError(f"config file {path} must hold a mapping of sections")
    _check_moved(tree)
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    retype(tree, overrides or {})
    _check_moved(tree)
    try:
        return (schema or Config).model_validate(tree)
    except ValidationError as exc:
        raise UserError("invalid config: " + "; ".join(_describe(e) for e in exc.errors())) from None


_TAGGED = {
    "buffer": ("redis", "memory"),
    "engine": ("vllm", "hf"),
    "weights": ("zmq", "shm", "nccl", "memory"),
    "episode": tuple(MEMBERS),
    "train": ("path", "source", "mixture"),  # a prompt source's form (asyncrl.config.data)
    "eval": ("path", "source", "sets"),
    "#": ("path", "source"),  # a list's item: a mixture's source (data.train.0)
}


def _describe(error: dict) -> str:
    loc = [str(p) for p in error["loc"]]
    # a typed section's errors carry its tag (weights.shm.dir): name the field as the user writes it
    parents = ["#" if p.isdigit() else p for p in ["", *loc]]  # each name's parent; the last has none
    loc = [p for p, parent in zip(loc, parents, strict=False) if p not in _TAGGED.get(parent, ())]
    field = ".".join(loc) or "config"
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        msg = "unknown field"
    got = error.get("input")
    if error["type"] != "extra_forbidden" and not isinstance(got, dict) and got is not None:
        msg += f" (got {got!r})"
    return f"{field}: {msg}"


def dump_config(cfg: Config, shown: bool = True) -> str:
    """The resolved config as YAML, secrets redacted: the Redis URL's always (processes get it from their
    environment); the tokens of reward and environment server URLs only where ``shown`` (``--dry-run``),
    since ``config.yaml`` (0600, read by the generators) must keep them."""
    from asyncrl.net import redact_url

    tree = cfg.model_dump(mode="json")
    served = [("data", "reward"), ("data", "eval_reward"), ("episode", "env_url")]  # reward and environment servers
    urls = [("buffer", "url"), *(served if shown else [])]
    for section, key in urls:
        value = tree[section].get(key)
        if isinstance(value, str) and value.startswith(("redis://", "rediss://", "http://", "https://")):
            tree[section][key] = redact_url(value)
    return yaml.safe_dump(tree, sort_keys=False)

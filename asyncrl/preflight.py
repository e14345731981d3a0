"""What ``asyncrl launch`` checks before it starts anything (``--dry-run`` runs the light part), and the
one thing it may build first: the demo model, at its recipe's own cache path only."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import RECIPE_PATHS, Config, ModelConfig
from asyncrl.errors import UserError


def preflight_light(cfg: Config, redis_url: str | None = None) -> None:
    """Everything that can be checked without building or starting anything; raises UserError."""
    from asyncrl.data import load_jsonl
    from asyncrl.episodes import load_episode
    from asyncrl.rewards import load_reward

    load_jsonl(cfg.data.train)
    if cfg.data.eval:
        load_jsonl(cfg.data.eval)
    load_reward(cfg.data.reward, cfg.episode.reward_timeout_s)  # imports it, or checks its URL
    load_episode(cfg.episode)  # the episode function or Env, its tools and tool parser
    check_model_path(cfg.model)
    check_prompt_lengths(cfg)
    check_host(cfg)
    from asyncrl.redis_server import check_redis_url, find_redis_binary

    redis_url = redis_url or external_redis_url(cfg)
    if redis_url:
        check_redis_url(redis_url)
    else:
        find_redis_binary()


def check_host(cfg: Config) -> None:
    """``run.host`` is an address of this machine that others can reach (binding beyond loopback is
    the user's explicit choice; it must name one concrete address, which is also what is advertised)."""
    import socket

    from asyncrl.net import is_loopback

    host = cfg.run.host
    if is_loopback(host):
        if cfg.run.remote_learners:
            raise UserError("learner ranks on other hosts (run.local_learners < run.learners) need --host (run.host)")
        return
    if host in ("0.0.0.0", "::", "*"):
        raise UserError(f"run.host={host} would listen everywhere: name the one address other hosts reach this one at")
    if cfg.weights.type == "shm":
        raise UserError("weights.type=shm serves one host only: generators on other hosts need weights.type=zmq")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
    except OSError as exc:
        raise UserError(f"run.host={host} is not an address of this machine ({exc.strerror})") from None


def external_redis_url(cfg: Config) -> str | None:
    """The Redis server the config names (``buffer.url``), if any; None: the launcher starts its own."""
    return cfg.buffer.url if cfg.buffer.type == "redis" else None


def preflight(cfg: Config, redis_url: str | None, log=print) -> None:
    built_here = not (Path(cfg.model.path) / "config.json").is_file()
    preflight_light(cfg, redis_url)
    ensure_model(cfg, log)
    if built_here:  # the light checks could not look at the prompts yet
        check_prompt_lengths(cfg)


def check_prompt_lengths(cfg: Config) -> None:
    """Every train and eval prompt leaves room for ``generator.max_new_tokens`` in the model's context;
    else one error naming the first such line (a generator would skip and count them, but a dataset
    that does not fit the model is a mistake better shown before the run). Needs the model's tokenizer:
    ``--dry-run`` checks only when the model is already there."""
    if not (Path(cfg.model.path) / "config.json").is_file():
        return
    from transformers import AutoTokenizer

    from asyncrl.data import numbered_jsonl
    from asyncrl.generators.engine import context_length, fits

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    tok.model_max_length = 1 << 62  # measuring here: transformers' "longer than the maximum" warning is ours to say
    context, budget = context_length(cfg.model.path), cfg.generator.max_new_tokens
    for path in [cfg.data.train, *([cfg.data.eval] if cfg.data.eval else [])]:
        lines = numbered_jsonl(path)
        lengths = [len(ids) for ids in tok([rec["prompt"] for _, rec in lines])["input_ids"]] if lines else []
        bad = [(lineno, n) for (lineno, _), n in zip(lines, lengths, strict=True) if not fits(n, budget, context)]
        if bad:
            (lineno, n), more = bad[0], len(bad) - 1
            raise UserError(
                f"{path}:{lineno}: the prompt is {n} tokens; with generator.max_new_tokens={budget} it needs "
                f"{n + budget}, more than the model's context of {context} tokens"
                + (f" ({more} more lines like it)" if more else "")
            )


def check_model_path(model: ModelConfig) -> None:
    """A model directory, or the recipe's own cache path (built on first use); else one error."""
    path = Path(model.path)
    if (path / "config.json").is_file() or model.builds_recipe:
        return
    what = "is not an HF model directory (no config.json)" if path.is_dir() else "does not exist"
    hint = f"; model.recipe={model.recipe} builds only at {RECIPE_PATHS[model.recipe]}" if model.recipe else ""
    raise UserError(f"model.path {path} {what}{hint}")


def ensure_model(cfg: Config, log=print) -> None:
    check_model_path(cfg.model)
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return
    from asyncrl.demo.model import prepare_demo_model

    log(f"building the demo model at {path} (once; cached)")
    prepare_demo_model(path, seed=cfg.run.seed, log=log, recipe=cfg.model.recipe)

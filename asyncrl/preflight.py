"""What ``asyncrl launch`` checks before it starts anything (``--dry-run`` runs the light part), and the
one thing it may build first: the demo model, at its recipe's own cache path only."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import RECIPE_PATHS, Config, ModelConfig
from asyncrl.errors import UserError


def preflight_light(cfg: Config, redis_url: str | None = None) -> None:
    """Everything that can be checked without building or starting anything; raises UserError."""
    from asyncrl.data import import_by_path, load_jsonl

    load_jsonl(cfg.data.train)
    if cfg.data.eval:
        load_jsonl(cfg.data.eval)
    import_by_path(cfg.data.reward)
    check_model_path(cfg.model)
    from asyncrl.redis_server import check_redis_url, find_redis_binary

    redis_url = redis_url or external_redis_url(cfg)
    if redis_url:
        check_redis_url(redis_url)
    else:
        find_redis_binary()


def external_redis_url(cfg: Config) -> str | None:
    """The Redis server the config names (``buffer.url``), if any; None: the launcher starts its own."""
    return cfg.buffer.url if cfg.buffer.type == "redis" else None


def preflight(cfg: Config, redis_url: str | None, log=print) -> None:
    preflight_light(cfg, redis_url)
    ensure_model(cfg, log)


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
    prepare_demo_model(path, seed=cfg.run.seed, log=log)

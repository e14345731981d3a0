"""What ``asyncrl launch`` checks before it starts anything (``--dry-run`` runs the light part; a
launch checks the prompts' lengths on a thread beside the children's start), and the one thing it may
build first: the model, either a recipe's (the demo models, ``smollm2-135m-instruct``) at the recipe's
own cache path only, or the HF directory of a ``.gguf`` named by ``model.path``.

A GGUF is converted here, once for the whole run and before any child starts (``asyncrl.models.gguf``
caches it by content). :func:`preflight` returns the config the run then uses, with ``model.path``
the converted directory: the launcher writes THAT config to ``runs/<name>/config.yaml`` (which every
child reads) and to Redis's ``meta config`` (which joiners read), so learners, generators and the
export all load the same directory and nothing else ever sees the GGUF."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import RECIPE_PATHS, Config, ModelConfig
from asyncrl.errors import UserError
from asyncrl.models import smollm2
from asyncrl.models.gguf import ensure_converted, is_gguf
from asyncrl.run.vision_checks import ImageTokens, check_vision_run

# a large source's first records whose lengths are checked (generators skip and count later misfits)
LENGTHS_CHECKED = 10_000


def preflight_light(cfg: Config, redis_url: str | None = None, prompts: bool = True) -> None:
    """Everything that can be checked without building or starting anything; raises UserError.
    ``prompts``: also the prompts' lengths (seconds: it loads transformers and the tokenizer)."""
    from asyncrl.episodes.kinds import load_episode
    from asyncrl.rewards.resolve import load_reward

    check_named(cfg)
    check_sources(cfg)
    train, held_out = cfg.data.reward_specs
    for spec in dict.fromkeys(filter(None, [*train, *held_out])):
        load_reward(spec, cfg.episode.reward_timeout_s)  # imports it, or checks its URL or export
    load_episode(cfg.episode)  # the episode function or Env, its tools and tool parser
    check_model_path(cfg.model)
    check_experts(cfg)
    check_vision_run(cfg)
    if cfg.model.recipe is None:  # a recipe draws its data's images when the launch builds or finds its model
        check_images(cfg)
    check_lora(cfg.model)
    if prompts:
        check_prompt_lengths(cfg)
    check_host(cfg)
    from asyncrl.observe.metrics import check_wandb

    check_wandb(cfg.run.wandb)
    from asyncrl.fleet.redis_server import check_redis_url, find_redis_binary

    redis_url = redis_url or external_redis_url(cfg)
    if redis_url:
        check_redis_url(redis_url)
    else:
        find_redis_binary()


def check_named(cfg: Config) -> None:
    """The core has no task of its own: a run names its model, prompts and reward (the demos' configs do)."""
    rewarded = cfg.data.reward or (cfg.data.train and None not in cfg.data.reward_specs[0])  # each source its own
    unset = [name for name, value in (("model.path", cfg.model.path), ("data.train", cfg.data.train),
                                      ("data.reward", rewarded)) if not value]  # fmt: skip
    if unset:
        raise UserError(
            f"the config sets no {', '.join(unset)}: a run names its model (or model.recipe), its prompts and its "
            "reward; configs/demo-cpu.yaml names the sort demo's"
        )


def check_lora(model: ModelConfig) -> None:
    """``model.lora`` needs peft, an optional extra."""
    import importlib.util

    if model.lora is not None and importlib.util.find_spec("peft") is None:
        raise UserError("model.lora trains through peft, which is not installed: pip install 'asyncrl[lora]'")


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


def preflight(cfg: Config, redis_url: str | None, log=print) -> Config:
    """Every check but the prompts' lengths (the launcher runs that one :func:`in_background`: it tokenizes
    every prompt, and where the model's tokenizer needs transformers it imports that, about 4 s on 2 cores,
    better spent beside the children's start), and the model built or converted if need be. Returns the
    config the run uses (``cfg``, or with ``model.path`` a GGUF's converted directory: see the module's doc)."""
    preflight_light(cfg, redis_url, prompts=False)
    cfg = ensure_model(cfg, log)
    if cfg.model.recipe is not None:  # a recipe drew its data's images just now (preflight_light checked the rest)
        check_images(cfg)
    return cfg


def check_images(cfg: Config) -> None:
    """Every image file that a train or eval record names is on disk; else one error naming the first."""
    from asyncrl.data import load_jsonl
    from asyncrl.run.vision_checks import check_images_exist

    for path in datasets(cfg):
        check_images_exist(path, load_jsonl(path))


def check_sources(cfg: Config) -> None:
    """The train and eval sources open, and each record will have a prompt (:mod:`asyncrl.data.sources`); images
    only in JSONL files, whose folder their paths are relative to."""
    for prompts in open_sources(cfg):
        if not prompts.is_jsonl and prompts.has_images:
            raise UserError(f"{prompts.name}: records with images are read from JSONL files only")


def open_sources(cfg: Config) -> list:
    """The run's sources, opened: ``data.train``'s, then each eval set's."""
    from asyncrl.data.sources import open_evals, open_train

    return [*open_train(cfg).sets, *open_evals(cfg)]


def in_background(chore: Callable[..., None], *args) -> Callable[..., None]:
    """``chore(*args)`` on a daemon thread. The returned ``wait(timeout=None)`` waits for it (at most
    ``timeout`` seconds) and, once it has ended, raises what it raised."""
    failed: list[BaseException] = []

    def target() -> None:
        try:
            chore(*args)
        except BaseException as exc:  # handed to the waiter, who raises it in its own thread
            failed.append(exc)

    thread = threading.Thread(target=target, name=getattr(chore, "__name__", "chore"), daemon=True)
    thread.start()

    def wait(timeout: float | None = None) -> None:
        thread.join(timeout)
        if failed:
            raise failed[0]

    return wait


def check_prompt_lengths(cfg: Config) -> None:
    """Every train and eval prompt leaves room for ``generator.max_new_tokens`` in the model's context;
    else one error naming the first such line (a generator would skip and count them, but a dataset
    that does not fit the model is a mistake better shown before the run). Needs the model's tokenizer:
    ``--dry-run`` checks only when the model is already there. The tokenizer is the ``tokenizers``
    library's where that encodes exactly as transformers' would (:func:`plain_tokenizer`; the launcher then
    never imports transformers and torch, about 3 CPU-seconds), else transformers' ``AutoTokenizer``."""
    if not (Path(cfg.model.path) / "config.json").is_file():
        return
    from asyncrl.chat import ChatTokens
    from asyncrl.data import has_images, prompt_of
    from asyncrl.generators.engine import fits

    tok = plain_tokenizer(cfg.model.path)
    if tok is None:
        from transformers import AutoTokenizer

        from asyncrl.models.vision import quiet_config_repr

        with quiet_config_repr():
            tok = AutoTokenizer.from_pretrained(cfg.model.path)
        tok.model_max_length = 1 << 62  # measuring here: transformers' "longer than the maximum" warning is ours
    chat = ChatTokens(tok, use_template=cfg.episode.chat_template, system_prompt=cfg.episode.system_prompt)
    context = _context_length(cfg.model.path, cfg.generator.max_model_len)
    budget = cfg.generator.max_new_tokens
    for source in open_sources(cfg):
        records = source.head(len(source) if source.is_jsonl else LENGTHS_CHECKED)
        prompts = [chat.prompt_ids(prompt_of(rec)) for rec in records]  # as the generators encode them
        lengths = [len(ids) for ids in prompts]
        if has_images(records):  # as the learner sees them: each image's tokens in place
            lengths = _with_images(cfg.model.path, source, records, prompts)
        bad = [(i, n) for i, n in enumerate(lengths) if not fits(n, budget, context)]
        if bad:
            (i, n), more = bad[0], len(bad) - 1
            raise UserError(
                f"{source.where(i)}: the prompt is {n} tokens; with generator.max_new_tokens={budget} it needs "
                f"{n + budget}, more than the model's context of {context} tokens"
                + (f" ({more} more records like it)" if more else "")
            )


def _with_images(model_path: str, source, records: list[dict], prompts: list[list[int]]) -> list[int]:
    """The prompts' lengths with each record's image tokens; one error for the first record whose placeholders
    and images disagree."""
    tokens = ImageTokens(model_path, source.name, records)
    out = []
    for i, (rec, ids) in enumerate(zip(records, prompts, strict=True)):
        if wrong := tokens.placeholder_problem(ids, rec):
            raise UserError(f"{source.where(i)}: {wrong}")
        out.append(len(ids) + tokens.extra(rec))
    return out


# tokenizer_config.json keys after which a generic fast tokenizer encodes exactly as its tokenizer.json does
# (any other key, a chat template, add_bos_token, added tokens of its own, ... may change transformers' encoding)
_PLAIN_KEYS = {"backend", "tokenizer_class", "model_max_length", "clean_up_tokenization_spaces"}
_SPECIAL_KEYS = {"bos_token", "eos_token", "pad_token", "unk_token"}
_GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


class _PlainTokenizer:
    """What :class:`asyncrl.chat.ChatTokens` uses of a tokenizer without a chat template: ``encode``."""

    chat_template = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def plain_tokenizer(model_path: str) -> _PlainTokenizer | None:
    """The model's ``tokenizer.json`` through the ``tokenizers`` library alone (milliseconds), where
    transformers' ``AutoTokenizer`` would encode exactly as it does: a generic fast tokenizer class, no chat
    template, special tokens that ``tokenizer.json`` already holds as special, no truncation or padding of its
    own, and no other setting in ``tokenizer_config.json``; else None (the caller uses transformers)."""
    import json

    path = Path(model_path)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in _GENERIC_CLASSES:
        return None
    if set(config) - _PLAIN_KEYS - _SPECIAL_KEYS or any((path / f).exists() for f in _TEMPLATE_FILES):
        return None
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # no tokenizer.json, or one this tokenizers cannot read: transformers decides
        return None
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    tokens = [config[k] for k in _SPECIAL_KEYS if config.get(k) is not None]
    if not all(isinstance(t, str) and t in special for t in tokens):
        return None
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    return _PlainTokenizer(tokenizer)


def _context_length(model_path: str, max_model_len: int | None) -> int:
    """``asyncrl.generators.engine.context_length`` from ``config.json`` where it names the model's
    ``max_position_embeddings`` (no transformers import); that function itself otherwise, and for its error."""
    import json

    try:
        model = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        model = None
    if type(model) is int and (max_model_len is None or max_model_len <= model):
        return model if max_model_len is None else max_model_len
    from asyncrl.generators.engine import context_length

    return context_length(model_path, max_model_len)


CPU_EXPERT_ALIGN = 32  # vLLM 0.32's CPU MoE kernel pads an expert's width to this, then refuses reloads


def check_experts(cfg: Config) -> None:
    """A mixture of experts vLLM's CPU backend would start but then fail to update (``moe_intermediate_size``
    not a multiple of 32: every weight version after the first fails and leaves the engine broken)."""
    import json

    from asyncrl.run.gpus import has_driver

    path = Path(cfg.model.path or "") / "config.json"
    if cfg.generator.engine.type != "vllm" or not path.is_file() or has_driver():
        return
    width = json.loads(path.read_text()).get("moe_intermediate_size")
    if isinstance(width, int) and width % CPU_EXPERT_ALIGN:
        raise UserError(
            f"model {cfg.model.path}: moe_intermediate_size {width} is not a multiple of {CPU_EXPERT_ALIGN}; vLLM's "
            f"CPU MoE kernel pads it and then refuses every weight update: use generator.engine.type=hf, or a width "
            f"that is a multiple of {CPU_EXPERT_ALIGN}"
        )


def check_model_path(model: ModelConfig) -> None:
    """A model directory, a ``.gguf`` file, or the recipe's own cache path (built on first use); else one
    error naming the path, and the recipe's own path when the config names a recipe."""
    if model.path is None:
        raise UserError("the config sets no model.path (nor a model.recipe, which builds at its own cache path)")
    path = Path(model.path)
    if (path / "config.json").is_file() or model.builds_recipe or (is_gguf(path) and path.is_file()):
        return
    what = "is not an HF model directory (no config.json)" if path.is_dir() else "does not exist"
    hint = f"; model.recipe={model.recipe} builds only at {RECIPE_PATHS[model.recipe]}" if model.recipe else ""
    raise UserError(f"model.path {path} {what}{hint}")


def ensure_model(cfg: Config, log=print) -> Config:
    """The model at ``model.path``, built by its recipe or converted from a GGUF if need be; returns the
    config whose ``model.path`` names the directory the run loads (``cfg`` itself unless a GGUF)."""
    check_model_path(cfg.model)
    path = Path(cfg.model.path)
    if is_gguf(path):
        directory = str(ensure_converted(path, log=log))
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": directory})})
    if cfg.model.recipe not in (None, smollm2.RECIPE):  # its data's drawn files, beside the run's dataset files
        from asyncrl.demo.recipes import ensure_data

        ensure_data(cfg.model.recipe, datasets(cfg), log)
    if (path / "config.json").is_file():
        return cfg
    if cfg.model.recipe == smollm2.RECIPE:
        smollm2.model_path(path, log=log)
        return cfg
    from asyncrl.demo.recipes import prepare_demo_model

    log(f"building the demo model at {path} (once; cached)")
    prepare_demo_model(path, seed=cfg.run.seed, log=log, recipe=cfg.model.recipe, datasets=datasets(cfg))
    return cfg


def datasets(cfg: Config) -> list[str]:
    """The run's JSONL prompt files (those that may name images): ``data.train``'s, and ``data.eval``'s where set."""
    if not hasattr(cfg.data, "train_sources"):  # an offline run's (asyncrl.config.offline): JSONL files by path
        return [path for path in (cfg.data.train, cfg.data.eval) if path is not None]
    sources = [*cfg.data.train_sources, *cfg.data.eval_sets]
    return [s.path for s in sources if s.path.endswith(".jsonl")]

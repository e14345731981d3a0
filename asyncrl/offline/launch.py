"""``asyncrl sft | rm | dpo``: check the config, the model and every example before anything starts, make
the run directory, start ``run.learners`` ranks of ``learners.offline`` on this host (as the RL
launcher starts learner ranks: loopback rendezvous, jemalloc, one process group each), echo rank 0's
progress, and end them all when one fails. Ctrl-C (even in a background job, which inherits SIGINT
ignored) and SIGTERM end the ranks too: exit code 130 after Ctrl-C, 143 after SIGTERM."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import yaml

from asyncrl.config.offline import OfflineConfig
from asyncrl.errors import UserError
from asyncrl.lifetime import Child, learner_env, stop_exit_code, stop_on_signals, stop_processes

POLL_S = 0.2


MODES = {
    "sft": "supervised fine-tuning on prompt/response (or chat) examples",
    "rm": "train a reward model on prompt/chosen/rejected pairs (Bradley-Terry)",
    "dpo": "direct preference optimisation on prompt/chosen/rejected pairs (DPO or IPO)",
}


def add_parsers(sub) -> None:
    for mode, what in MODES.items():
        p = sub.add_parser(mode, help=what)
        p.add_argument("--config", help="YAML config (docs/offline.md); defaults apply to the rest")
        p.add_argument("--learners", type=int, help="learner ranks on this host (run.learners)")
        p.add_argument("--steps", type=int, help="optimizer steps (run.steps)")
        p.add_argument("--name", help="run name; the run directory is runs/<name> (run.name)")
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="dotted config override"
        )
        p.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="go on with the run in RUN_DIR (runs/<name>) from its last checkpoint, with its own config "
            "(change it with --set or --steps)",
        )
        p.add_argument("--dry-run", action="store_true", help="check the config and data, print it; start nothing")
        p.set_defaults(func=functools.partial(cmd_offline, mode))


def cmd_offline(mode: str, args) -> int:
    from asyncrl.config import load_config, parse_override

    stop_on_signals()  # Ctrl-C raises KeyboardInterrupt whatever was inherited; SIGTERM the same stop

    overrides = dict(parse_override(o) for o in args.overrides)
    flags = {"run.learners": args.learners, "run.steps": args.steps, "run.name": args.name}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    if args.resume:
        run_dir = Path(args.resume)
        if args.config or args.name:
            raise UserError("--resume reads the run's own config.yaml and name; change the config with --set")
        if _read_mode(run_dir) != mode:
            raise UserError(f"{run_dir} is not an asyncrl {mode} run (it holds {_read_mode(run_dir) or 'none'})")
        overrides.update({"run.out_dir": str(run_dir.parent), "run.name": run_dir.name})
        cfg = load_config(run_dir / "config.yaml", overrides, schema=OfflineConfig)
    else:
        cfg = load_config(args.config, overrides, schema=OfflineConfig)
    if args.dry_run:
        cfg = preflight(cfg, mode, build=False)
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    return launch(cfg, mode, resume=bool(args.resume))


MODE_FILE = "mode"  # a run directory's training mode: what --resume checks


def _read_mode(run_dir: Path) -> str | None:
    try:
        return (run_dir / MODE_FILE).read_text().strip()
    except OSError:
        return None


def preflight(cfg: OfflineConfig, mode: str, log=print, build: bool = True) -> OfflineConfig:
    """Every check that needs no rank: the model (built by its recipe or converted if need be; with
    ``build`` False only looked for), the examples (each line parsed and, once the model is there,
    tokenized and within ``data.max_len``), the reward function. Returns the config the run uses (a GGUF
    ``model.path`` becomes its converted directory)."""
    from asyncrl.data import numbered_jsonl
    from asyncrl.offline.data import record_problem
    from asyncrl.run.preflight import check_model_path, ensure_model

    if mode == "rm" and cfg.model.lora is not None:
        raise UserError("model.lora applies to sft and dpo: a reward model trains its base and head in full")
    from asyncrl.run.preflight import check_lora

    check_lora(cfg.model)
    if cfg.data.reward and cfg.learner.zero_stage == 3:
        raise UserError("data.reward's greedy evaluation generates on each rank alone: it needs learner.zero_stage < 3")
    for path in filter(None, (cfg.data.train, cfg.data.eval)):
        numbered_jsonl(path, lambda rec: record_problem(mode, rec))
    if cfg.data.reward:
        from asyncrl.rewards.resolve import load_reward

        load_reward(cfg.data.reward, 30.0)  # imports it, or checks its URL or reward model export
    check_model_path(cfg.model)
    from asyncrl.run.vision_checks import is_vision_dir

    if is_vision_dir(cfg.model.path):  # its examples would need images, its trainer the processor's pixels
        raise UserError(f"model {cfg.model.path} is a vision-language model: asyncrl {mode} trains text models only")
    if build:
        cfg = ensure_model(cfg, log)
    elif not (Path(cfg.model.path) / "config.json").is_file():
        return cfg
    from transformers import AutoTokenizer

    from asyncrl.chat import ChatTokens
    from asyncrl.offline.data import load_examples

    chat = ChatTokens(
        AutoTokenizer.from_pretrained(cfg.model.path),
        use_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
    )
    train = load_examples(cfg.data.train, mode, chat, cfg.data.max_len)
    if len(train) < cfg.train.batch_size:
        batch = cfg.train.batch_size
        raise UserError(f"{cfg.data.train} has {len(train)} examples, fewer than train.batch_size={batch}")
    if cfg.data.eval:
        held_out = load_examples(cfg.data.eval, mode, chat, cfg.data.max_len)
        if min(len(held_out), cfg.data.eval_size) < cfg.run.learners:
            raise UserError(f"{cfg.data.eval}: fewer held-out examples than run.learners ({cfg.run.learners})")
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: OfflineConfig, mode: str, log=print, resume: bool = False) -> int:
    """Run ``mode`` training to the end (``resume``: in the existing run directory, whose ranks go on from
    its last checkpoint); the exit code (0 when every rank finished, 1 when one failed)."""
    cfg = preflight(cfg, mode, log)
    run_dir = cfg.run_dir
    if run_dir.exists() and not resume:
        if not cfg.run.overwrite:
            raise UserError(
                f"{run_dir} exists: go on with it (asyncrl {mode} --resume {run_dir}), choose another run.name, "
                "or set run.overwrite=true to start over"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=resume)
    (run_dir / MODE_FILE).write_text(mode)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    world = cfg.run.learners
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "GLOO_SOCKET_IFNAME": "lo",
        "ASYNCRL_TORCH_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
    }
    base = learner_env(base, cfg.learner.jemalloc, log)
    cmd = [sys.executable, "-m", "asyncrl.offline.train", "--mode", mode, "--config", str(config_path)]
    ranks = [
        Child("learner", r, cmd, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, run_dir / f"rank-{r}.out")
        for r in range(world)
    ]
    log(f"{mode}: {world} rank(s), {cfg.run.steps} steps; logs in {run_dir}")
    for rank in ranks:
        rank.start()
    try:
        return _supervise(ranks, mode, log)
    except KeyboardInterrupt as stop:
        code = stop_exit_code(stop)
        log(f"{mode}: {'terminated' if code == 143 else 'interrupted'}; stopping the ranks")
        return code
    finally:
        stop_processes(ranks, grace_s=0.0)


def _supervise(ranks: list[Child], mode: str, log) -> int:
    """Echo rank 0's progress lines until every rank has exited; 1 (and the failed rank's log tail) as
    soon as one fails."""
    shown, prefix = 0, f"[{mode}]"
    while True:
        lines = _read_lines(ranks[0].log_path)
        for line in lines[shown:]:
            if line.startswith(prefix):
                log(line)
        shown = len(lines)
        failed = [r for r in ranks if r.proc.poll() not in (None, 0)]
        if failed:  # a rank killed by a signal is the cause; the others' collectives failed after it
            r = min(failed, key=lambda c: (c.proc.returncode >= 0, c.ident))
            log(f"{mode}: {r.name} failed (exit code {r.proc.returncode}); the end of {r.log_path}:\n{r.log_tail(20)}")
            log(f"{mode}: go on from the last checkpoint with: asyncrl {mode} --resume {r.log_path.parent}")
            return 1
        if all(r.proc.poll() == 0 for r in ranks):
            for line in _read_lines(ranks[0].log_path)[shown:]:
                if line.startswith(prefix):
                    log(line)
            return 0
        time.sleep(POLL_S)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []

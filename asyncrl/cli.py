"""The ``asyncrl`` command line. Imports stay light: heavy modules load only in the subcommand."""

from __future__ import annotations

import argparse
import sys

from asyncrl.errors import UserError


def _launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="run a training job on this machine")
    p.add_argument("--config", help="YAML run config (defaults apply to anything it leaves out)")
    p.add_argument("--generators", type=int, help="generator processes (run.generators)")
    p.add_argument("--learners", type=int, help="learner ranks (run.learners)")
    p.add_argument("--max-policy-lag", type=int, help="k: 0 = synchronous on-policy, k = bounded async")
    p.add_argument("--steps", type=int, help="learner steps (run.steps)")
    p.add_argument("--name", help="run name; the run directory is runs/<name> (run.name)")
    p.add_argument("--redis-url", help="use this Redis server instead of starting one")
    p.add_argument(
        "--host",
        help="an address of this host for the run's Redis and weight bus to listen on besides loopback, so "
        "generators on other hosts can join (run.host)",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the stopped or crashed run in RUN_DIR (runs/<name>) from its committed checkpoint, "
        "with its own config (change it with --set or the flags above)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, e.g. --set learner.lr=1e-5 (repeatable)",
    )
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: every process on this machine; ray: learners and generators as actors of a running Ray "
        "cluster (this machine is its head: the run's Redis stays here)",
    )
    p.add_argument("--address", help="the Ray cluster to join with --backend ray: auto (default) or HOST:PORT")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; start nothing")
    p.add_argument(
        "--show-prompts",
        type=int,
        metavar="N",
        help="with --dry-run: also print the run's first N prompts as the model sees them (chat template "
        "applied, decoded from the token ids the generators will send)",
    )
    p.set_defaults(func=cmd_launch)


def resolve_config(args):
    from asyncrl.config import load_config, parse_override

    overrides = dict(parse_override(o) for o in args.overrides)
    flags = {
        "run.generators": args.generators,
        "run.learners": args.learners,
        "run.max_policy_lag": args.max_policy_lag,
        "run.steps": args.steps,
        "run.name": args.name,
        "buffer.url": args.redis_url,
        "run.host": args.host,
    }
    overrides.update({k: v for k, v in flags.items() if v is not None})
    if not args.resume:
        return load_config(args.config, overrides)
    from pathlib import Path

    run_dir = Path(args.resume)
    if args.config or args.name:
        raise UserError("--resume reads the run's own config.yaml and name; change the config with --set")
    overrides.update({"run.out_dir": str(run_dir.parent), "run.name": run_dir.name})
    cfg = load_config(run_dir / "config.yaml", overrides)
    if cfg.buffer.type == "redis" and cfg.buffer.url and "***" in cfg.buffer.url:
        raise UserError(
            "the run used an external Redis server: resume it with --redis-url (the stored URL is redacted)"
        )
    return cfg


def cmd_launch(args) -> int:
    from rich.console import Console

    from asyncrl.lifetime import stop_on_signals

    stop_on_signals()  # Ctrl-C even in a background job; SIGTERM the same stop (exit codes 130, 143)
    if args.show_prompts is not None and not args.dry_run:
        raise UserError("--show-prompts goes with --dry-run (it prints prompts instead of starting a run)")
    # The launcher compiles no kernels. transformers' import (the prompt check, for a tokenizer that needs it)
    # reaches torch's dynamo, which imports triton only to ask whether it is there, and triton prints a
    # nanobind "leaked" dump at exit.
    sys.modules.setdefault("triton", None)

    from asyncrl.config import dump_config

    console = Console(stderr=True)
    cfg = resolve_config(args)
    if args.dry_run:
        from asyncrl.run.preflight import preflight_light

        preflight_light(cfg)
        if args.backend != "ray":  # the local launch's GPU layout (Ray places its actors itself)
            from asyncrl.run.gpus import plan_gpus, visible_gpus

            plan_gpus(cfg, visible_gpus())
        print(dump_config(cfg), end="")
        if args.show_prompts:
            from asyncrl.run.samples import show_prompts

            print(show_prompts(cfg, args.show_prompts), end="")
        return 0
    from asyncrl.run.launch import Launcher

    resume = None
    if args.resume:
        from asyncrl.run.resume import check_resumable, load_resume_point

        resume = load_resume_point(cfg.run_dir)
        check_resumable(resume, cfg.run.steps)
    if args.backend == "ray":
        from asyncrl.run.ray_backend import RayLauncher

        launcher = RayLauncher(cfg, address=args.address or "auto", console=console, resume=resume)
    elif args.address:
        raise UserError("--address names a Ray cluster: it goes with --backend ray")
    else:
        launcher = Launcher(cfg, console=console, resume=resume)
    code = launcher.run()
    from asyncrl.run.stats import summary_line

    console.print(summary_line(cfg.run.name, launcher.stats.summary(""), cfg.run_dir))
    return code


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="show a run's versions, buffer, learners and generators")
    p.add_argument("run_pos", nargs="?", metavar="RUN", help="the run: its name or its directory (runs/<name>)")
    p.add_argument("--run", help="the same as RUN: a run name or directory; works after the run ended too")
    p.add_argument("--redis-url", help="read the run on this Redis server instead")
    p.add_argument(
        "--prefix", help="the run's key prefix, asyncrl:{<run-id>}: (with --redis-url; default: its only run)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    import json

    from asyncrl.observe.status import render, status
    from asyncrl.rundir import find_run_dir

    named = [r for r in (args.run_pos, args.run) if r is not None]
    if len(named) + (args.redis_url is not None) != 1:
        raise UserError("asyncrl status takes one run: its name or directory (RUN or --run), or --redis-url")
    if args.prefix and named:
        raise UserError("--prefix goes with --redis-url; a run directory names its own prefix")
    run = find_run_dir(named[0]) if named else None
    snapshot = status(run=run, redis_url=args.redis_url, prefix=args.prefix)
    if args.json:
        print(json.dumps(snapshot, indent=2))
    else:
        from rich.console import Console

        render(snapshot, Console())
    return 0


def _address_args(p) -> None:
    """``--host`` and ``--port`` of a server (reward-serve, env-serve, agent-serve)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one; the URL is printed)")


def _token_file_arg(p, token_env: str) -> None:
    """A server's ``--token-file`` (asyncrl.service.http.load_token), ``token_env`` its fallback."""
    p.add_argument(
        "--token-file",
        help=f"file holding the bearer token (made, mode 600, if missing); default: ${token_env}, "
        "else a new temporary file",
    )


def _reward_serve_parser(sub) -> None:
    p = sub.add_parser("reward-serve", help="serve a reward function over HTTP from worker processes")
    p.add_argument("--reward", required=True, metavar="MODULE:FUNCTION", help="the reward function to serve")
    _address_args(p)
    p.add_argument("--workers", type=int, help="worker processes (default: one per CPU)")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=20.0,
        help="hard limit of one item; a worker past it is killed and replaced (keep it under the clients' "
        "episode.reward_timeout_s)",
    )
    _token_file_arg(p, "ASYNCRL_REWARD_TOKEN")
    p.set_defaults(func=cmd_reward_serve)


def cmd_reward_serve(args) -> int:
    from asyncrl.rewards.serve import serve

    return serve(
        args.reward,
        host=args.host,
        port=args.port,
        workers=args.workers,
        deadline_s=args.deadline_s,
        token_file=args.token_file,
    )


def _env_serve_parser(sub) -> None:
    p = sub.add_parser("env-serve", help="serve an environment class's sessions over HTTP from worker processes")
    p.add_argument("--env", required=True, metavar="MODULE:CLASS", help="the environment class (plain or async)")
    _address_args(p)
    p.add_argument("--workers", type=int, help="worker processes hosting the sessions (default: one per CPU)")
    p.add_argument("--threads", type=int, default=32, help="calls one worker runs at once (default 32)")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=20.0,
        help="hard limit of one reset, step or close; a worker past it is killed (keep it under the clients' "
        "episode.step_timeout_s)",
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=600.0,
        help="a session with no request for this long is closed (its episode's generator is gone)",
    )
    p.add_argument("--memory-mb", type=int, help="a worker whose resident memory passes this is killed")
    _token_file_arg(p, "ASYNCRL_ENV_TOKEN")
    p.set_defaults(func=cmd_env_serve)


def cmd_env_serve(args) -> int:
    from asyncrl.episodes.env_serve import Settings, serve
    from asyncrl.observe.metrics import setup_logging

    setup_logging(name="env-serve")
    return serve(
        Settings(
            args.env,
            host=args.host,
            port=args.port,
            workers=args.workers,
            threads=args.threads,
            deadline_s=args.deadline_s,
            lease_s=args.lease_s,
            memory_mb=args.memory_mb,
            token_file=args.token_file,
        )
    )


def _agent_serve_parser(sub) -> None:
    p = sub.add_parser("agent-serve", help="serve an OpenAI-API agent that plays a run's episodes (episode.agent_url)")
    p.add_argument("--agent", required=True, metavar="MODULE:FUNCTION", help="an `async def agent(client, task)`")
    _address_args(p)
    p.add_argument(
        "--deadline-s",
        type=float,
        default=3600.0,
        help="an episode still playing after this long is cancelled (keep it above the clients' "
        "episode.episode_timeout_s)",
    )
    _token_file_arg(p, "ASYNCRL_AGENT_TOKEN")
    p.set_defaults(func=cmd_agent_serve)


def cmd_agent_serve(args) -> int:
    from asyncrl.gateway.agent_serve import serve
    from asyncrl.observe.metrics import setup_logging

    setup_logging(name="agent-serve")
    return serve(args.agent, host=args.host, port=args.port, deadline_s=args.deadline_s, token_file=args.token_file)


def _plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a PNG dashboard of one or more runs (overlaid) from their metrics")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<name>); a live run works too")
    p.add_argument("-o", "--out", help="the PNG to write (default: RUN_DIR/dashboard.png of the first run)")
    p.add_argument("--dpi", type=int, default=80, help="resolution: the image is 30 x 9 inches (default 80)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    from asyncrl.observe.plot import dashboard

    print(dashboard(args.runs, args.out, dpi=args.dpi))
    return 0


def cmd_prepare_demo(args) -> int:
    from asyncrl.config import load_config
    from asyncrl.run.preflight import ensure_model

    ensure_model(load_config(args.config), log=print)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from asyncrl import __version__

    ap = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL for language models.")
    ap.add_argument("--version", action="version", version=f"asyncrl {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    _launch_parser(sub)
    _status_parser(sub)
    _reward_serve_parser(sub)
    _env_serve_parser(sub)
    _agent_serve_parser(sub)
    _plot_parser(sub)
    from asyncrl.run import join

    join.add_parsers(sub)
    from asyncrl.run import slurm

    slurm.add_parser(sub)
    from asyncrl.offline import launch as offline_launch

    offline_launch.add_parsers(sub)
    p = sub.add_parser("prepare-demo", help="build (once) the demo model named by a config")
    p.add_argument("--config", default="configs/demo-cpu.yaml")
    p.set_defaults(func=cmd_prepare_demo)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except UserError as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM where the command asked for it (asyncrl.lifetime)
        from asyncrl.lifetime import stop_exit_code

        code = stop_exit_code(stop)
    sys.exit(code)


if __name__ == "__main__":
    main()

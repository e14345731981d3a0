"""``asyncrl generator``, ``asyncrl learner`` and ``asyncrl redis``: one process joining a running job, from
this host or any other (the rendezvous they use is ``asyncrl.fleet.rendezvous``)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from asyncrl.errors import UserError
from asyncrl.fleet.rendezvous import RunEnded, engine_env, locate, open_run
from asyncrl.keys import MASTER_FIELD


def _ctrl_c_is_sigterm(signum, frame) -> None:
    """Ctrl-C leaves as SIGTERM does: once serving, the generator's clean leave (its slots given back at
    once, exit 0); before that, SIGTERM's default end. Whatever the process inherited (a background job
    has SIGINT ignored)."""
    os.kill(os.getpid(), signal.SIGTERM)


def cmd_generator(args) -> int:
    signal.signal(signal.SIGINT, _ctrl_c_is_sigterm)
    url, prefix = locate(args)
    try:
        control, prefix, cfg = open_run(url, prefix)
    except RunEnded as exc:  # a join that came late (a queued SLURM job): nothing to do, no failure
        print(f"asyncrl generator: {exc}", flush=True)
        return 0
    ident = args.id or control.new_id("generator", socket.gethostname().split(".")[0])
    for key, value in engine_env(None).items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncrl.generators.worker import serve
    from asyncrl.observe.metrics import setup_logging

    setup_logging(args.log_file, name=f"generator-{ident}")
    serve(cfg, ident, url, prefix)
    return 0


def cmd_learner(args) -> int:
    """One learner rank on this host, of a run whose launcher left it to other hosts (run.local_learners)."""
    from asyncrl.lifetime import stop_on_signals
    from asyncrl.net import interface_of, local_address_to

    stop_on_signals(sigterm=False)  # Ctrl-C: KeyboardInterrupt (exit 130) whatever was inherited
    url, prefix = locate(args)
    try:
        control, prefix, cfg = open_run(url, prefix)
    except RunEnded as exc:
        print(f"asyncrl learner: {exc}", flush=True)
        return 0
    first = cfg.run.learners - cfg.run.remote_learners
    if not first <= args.rank < cfg.run.learners:
        ranks = f"{first}..{cfg.run.learners - 1}" if cfg.run.remote_learners else "none"
        raise UserError(f"--rank {args.rank}: the ranks this run leaves to other hosts are {ranks}")
    host, _, port = control.wait_meta(MASTER_FIELD, timeout_s=120).rpartition(":")
    os.environ.update(
        RANK=str(args.rank),
        LOCAL_RANK=str(args.local_rank),
        WORLD_SIZE=str(cfg.run.learners),
        MASTER_ADDR=host,
        MASTER_PORT=port,
        GLOO_SOCKET_IFNAME=interface_of(local_address_to(host)),  # gloo's sockets face the other ranks
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncrl.learners.trainer import serve
    from asyncrl.observe.metrics import setup_logging

    setup_logging(args.log_file, name=f"learner-{args.rank}")
    serve(cfg, url, prefix)
    return 0


def cmd_redis(args) -> int:
    """A run's Redis server on its own (``asyncrl launch --redis-url`` and generators meet on it)."""
    import time

    from asyncrl.fleet.redis_server import start_redis_server
    from asyncrl.secret import read_secret, redis_password

    secret = read_secret(args.secret_file)
    if secret is None:
        raise UserError("the run's Redis needs its secret (the password derives from it): set $ASYNCRL_SECRET")
    stop = []  # Ctrl-C or SIGTERM (whatever was inherited) stops the server: exit 0, its AOF flushed
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    server = start_redis_server(Path(args.dir), password=redis_password(secret), host=args.host, port=args.port)
    print(f"redis-server listening on {args.host or '127.0.0.1'}:{server.port} (pid {server.pid})", flush=True)
    try:
        while not stop and server.is_running():
            time.sleep(0.2)
    finally:
        server.stop()
    return 0 if stop else 1


def add_parsers(sub) -> None:
    p = sub.add_parser("generator", help="join a running job as one more generator (on this host or another)")
    _join_arguments(p)
    p.add_argument("--id", help="this generator's name (default: <host>-<n>, n counted by the run)")
    p.set_defaults(func=cmd_generator)

    p = sub.add_parser("learner", help="join a running job as one of its learner ranks (on another host)")
    _join_arguments(p)
    p.add_argument("--rank", type=int, required=True, help="this rank (one the launcher left to other hosts)")
    p.add_argument("--local-rank", type=int, default=0, help="its index among this host's ranks (its GPU)")
    p.set_defaults(func=cmd_learner)

    p = sub.add_parser("redis", help="start a run's Redis server on its own (password from the run's secret)")
    p.add_argument("--dir", required=True, help="its data directory (append-only file)")
    p.add_argument("--host", help="an address of this host to listen on besides loopback")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, printed)")
    p.add_argument("--secret-file", help="file holding the run's secret (default: $ASYNCRL_SECRET)")
    p.set_defaults(func=cmd_redis)


def _join_arguments(p) -> None:
    """Where the run is, for a process joining it."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis", metavar="HOST:PORT", help="the run's Redis server, as `asyncrl launch` printed it")
    where.add_argument("--run", metavar="RUN_DIR", help="a run directory on this host (runs/<name>): its address")
    p.add_argument(
        "--secret-file", help="file holding the run's secret (default: $ASYNCRL_SECRET; with --run, the run's own)"
    )
    p.add_argument("--prefix", help="the run's key prefix, when the server holds several runs")
    p.add_argument("--log-file", help="also log to this file")

"""Processes that join a running job from anywhere: ``asyncrl generator`` and ``asyncrl redis``.

Redis is the one rendezvous. The launcher writes the run's resolved config and its advertised Redis
address into the run's metadata (:func:`publish_run`); learner rank 0 adds the weight-bus address.
A generator started against a running job needs only the Redis address and the run's secret
(``asyncrl.secret``): from them it derives the password, finds the run's key prefix, reads the
config and the weight-bus address, takes a lease in the fleet and starts serving. It never reads the
run directory, except with ``--run``, a same-host (or shared-disk) shorthand for the address and secret.

Membership is a lease per generator (``RunControl.join`` / ``renew`` / ``leave``): renewed every
tick, given up on a clean exit (SIGTERM), and reaped by the launcher when it expires (SIGKILL, a
lost host), which gives the generator's unpushed groups back to admission.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from urllib.parse import quote

from asyncrl.errors import UserError

# Metadata fields (``P meta``) a joining process reads.
CONFIG_FIELD = "config"  # the resolved config, YAML (secrets redacted)
REDIS_FIELD = "redis_address"  # host:port, as other hosts reach it
MASTER_FIELD = "learner_master"  # host:port of the learners' rendezvous, when ranks join from other hosts


def publish_run(control, config_text: str, redis_address: str) -> None:
    """The launcher: what a process joining the run needs, besides the secret."""
    control.set_meta(CONFIG_FIELD, config_text)
    control.set_meta(REDIS_FIELD, redis_address)


def watch_fleet(control, buffer, known: set[str], log) -> set[str]:
    """The launcher, every poll: give back the slots of generators whose lease expired (SIGKILLed or
    cut off, wherever they ran), and log every change of the live fleet (also as the metric
    ``fleet/generators``). Returns the live fleet."""
    import time

    for ident, groups in control.reap("generator").items():
        log(f"generator {ident} stopped renewing its lease: gone; {groups} unpushed groups given back")
        if groups:
            buffer.release(groups)
    fleet = set(control.members("generator"))
    if fleet != known:
        change = ", ".join(
            [*(f"{g} joined" for g in sorted(fleet - known)), *(f"{g} left" for g in sorted(known - fleet))]
        )
        log(f"generators: {len(fleet)} live ({change})")
        control.emit({"fleet/generators": len(fleet), "time": time.time()})
    return fleet


def wait_for_leaves(control, timeout_s: float, log) -> None:
    """The launcher, stopping: generators that joined from elsewhere see the run's stop and leave;
    give them ``timeout_s`` to do so before the Redis server they need goes away."""
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while (fleet := control.members("generator")) and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - redis may be the thing that failed
        return
    if fleet:
        log(f"generators still in the fleet at the end, left to their leases: {', '.join(fleet)}")


def engine_env(engine, core: int | None) -> dict[str, str]:
    """The environment a generator's engine needs before it is imported (launched or joined)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in-process: starts in seconds
    if core is not None:  # vLLM's CPU backend pins OpenMP threads; one core each keeps them apart
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if engine.type == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine.kv_cache_gb)
    return env


def redis_url(address: str, secret: str) -> str:
    from asyncrl.secret import redis_password

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--redis takes HOST:PORT, not {address!r}")
    return f"redis://:{quote(redis_password(secret), safe='')}@{host}:{port}/0"


def locate(args) -> tuple[str, str | None]:
    """(Redis URL, prefix or None) from ``--run`` or ``--redis`` and the secret."""
    from asyncrl.secret import ENV, read_secret

    if args.run:
        from asyncrl.status import read_run_info

        run_dir = Path(args.run)
        if not (run_dir / "run.json").is_file():
            raise UserError(f"{run_dir} is not a run directory (no run.json): has its launch started?")
        info = read_run_info(run_dir)
        secret = read_secret(args.secret_file or run_dir / "secret")
        address, prefix = info["redis_address"], args.prefix or info.get("prefix")
    else:
        secret, address, prefix = read_secret(args.secret_file), args.redis, args.prefix
        if secret is None:
            raise UserError("joining a run needs its secret: set $ASYNCRL_SECRET or pass --secret-file")
    os.environ[ENV] = secret  # where this process's weight bus and any child find it
    return redis_url(address, secret), prefix


def open_run(url: str, prefix: str | None):
    """(control, prefix, config) of the run on the server at ``url``."""
    from asyncrl.config import load_config
    from asyncrl.control import RunControl, connect
    from asyncrl.redis_server import check_redis_url, redact_url

    check_redis_url(url)
    if prefix is None:
        from asyncrl.status import find_prefixes

        found = find_prefixes(connect(url))
        if len(found) != 1:
            where = redact_url(url)
            raise UserError(f"{len(found)} runs at {where}: {', '.join(found) or '-'}; name one with --prefix")
        prefix = found[0]
    control = RunControl(connect(url), prefix)
    text = control.get_meta(CONFIG_FIELD)
    if text is None:
        raise UserError(f"run {prefix} publishes no config: it was started by an older asyncrl, or is not running")
    if control.stop_requested():
        raise UserError(f"run {prefix} is stopping or has ended: nothing to join")
    return control, prefix, load_config(None, text=text)


def cmd_generator(args) -> int:
    url, prefix = locate(args)
    control, prefix, cfg = open_run(url, prefix)
    ident = args.id or control.new_id("generator", socket.gethostname().split(".")[0])
    for key, value in engine_env(cfg.generator.engine, None).items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncrl.generators.worker import serve
    from asyncrl.metrics import setup_logging

    setup_logging(args.log_file, name=f"generator-{ident}")
    serve(cfg, ident, url, prefix)
    return 0


def cmd_learner(args) -> int:
    """One learner rank on this host, of a run whose launcher left it to other hosts (run.local_learners)."""
    from asyncrl.net import interface_of, local_address_to

    url, prefix = locate(args)
    control, prefix, cfg = open_run(url, prefix)
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
    from asyncrl.learners.worker import serve
    from asyncrl.metrics import setup_logging

    setup_logging(args.log_file, name=f"learner-{args.rank}")
    serve(cfg, url, prefix)
    return 0


def cmd_redis(args) -> int:
    """A run's Redis server on its own (``asyncrl launch --redis-url`` and generators meet on it)."""
    import time

    from asyncrl.redis_server import start_redis_server
    from asyncrl.secret import read_secret, redis_password

    secret = read_secret(args.secret_file)
    if secret is None:
        raise UserError("the run's Redis needs its secret (the password derives from it): set $ASYNCRL_SECRET")
    server = start_redis_server(Path(args.dir), password=redis_password(secret), host=args.host, port=args.port)
    print(f"redis-server listening on {args.host or '127.0.0.1'}:{server.port} (pid {server.pid})", flush=True)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
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

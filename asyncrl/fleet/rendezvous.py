"""The rendezvous of processes that join a running job from anywhere (``asyncrl.run.join``'s commands).

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

import json
import os
import time
from pathlib import Path
from urllib.parse import quote

from asyncrl.errors import UserError
from asyncrl.keys import CONFIG_FIELD, REDIS_FIELD, starting_field


class RunEnded(UserError):
    """The run to join is stopping or has ended: there is nothing to join, which is no failure (the
    joining commands say so in one line and exit 0, so a job that arrives late is not a failed job)."""


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
        released = buffer.release_held(ident, resume=True, reaped=groups)  # journaled ones are resumed
        log(
            f"generator {ident} stopped renewing its lease: gone; {released} unpushed groups given back, "
            f"{groups - released} to resume"
        )
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


def still_starting(control, names: list[tuple[str, str, str]]) -> str:
    """What each of ``names`` ((role, id, log path)) said it waits for while it starts (``starting:<role>-<id>``
    in the run's metadata, :func:`asyncrl.keys.starting_field`), as one line: ``learner-0: <what> (for N s); ...``."""
    said = []
    for role, ident, log_path in names:
        raw = control.get_meta(starting_field(role, ident))
        state = json.loads(raw) if raw else None
        if state is None:
            said.append(f"{role}-{ident}: has said nothing yet (see {log_path})")
        else:
            said.append(f"{role}-{ident}: {state['what']} (for {time.time() - state['since']:.0f} s)")
    return "; ".join(said)


def engine_env(core: int | None) -> dict[str, str]:
    """The environment a generator's engine needs before it is imported (launched or joined)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in-process: starts in seconds
    if core is not None:  # vLLM's CPU backend pins OpenMP threads; one core each keeps them apart
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
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
        from asyncrl.rundir import read_run_info

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
    """(control, prefix, config) of the run on the server at ``url``; :class:`RunEnded` when its stop
    is set, :class:`UserError` (one line) for anything else that keeps it from being joined."""
    import redis

    from asyncrl.config import load_config
    from asyncrl.control import RunControl, connect
    from asyncrl.fleet.redis_server import check_redis_url, redact_url

    check_redis_url(url)
    try:
        if prefix is None:
            from asyncrl.control import find_prefixes

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
            raise RunEnded(f"run {prefix} is stopping or has ended: nothing to join")
    except redis.RedisError as exc:  # the server went away after it answered: a run ending as we join, often
        message = str(exc).replace(url, redact_url(url))
        raise UserError(f"lost the run's Redis at {redact_url(url)} while joining: {message}") from None
    return control, prefix, load_config(None, text=text)

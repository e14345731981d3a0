"""``asyncrl status``: one snapshot of a run, read from its Redis: versions, buffer, learners, generators.

Where the snapshot comes from:

* a run directory whose redis-server answers (the URL is in ``redis.url``, mode 0600): read live;
* a run directory whose server is gone (the launcher stops it at the end): its ``redis_dir`` is
  copied to a temporary directory and a private redis-server loads the copied append-only file, so
  the run directory is never changed and the numbers are those of the run's last write;
* ``--redis-url`` (and ``--prefix``, unless exactly one run lives on that server): read live.

Reading is side-effect free for a run that exists: the only write is ``RedisBuffer``'s idempotent
creation of the consumer group, which every run has already. ``collect_status`` returns plain,
JSON-ready data (``--json`` prints it as is); ``render`` turns it into tables. The password is
never printed: servers are named by ``host:port`` only.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.buffers.base import (
    DEAD_MAX_ENTRIES,
    STAT_KEYS,
    BufferUnavailableError,
    live_groups,
    lost_groups,
    unfinished_groups,
)
from asyncrl.buffers.redis_buffer import GROUP, RedisBuffer
from asyncrl.control import RunControl, find_prefixes
from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import check_redis_url, start_redis_server
from asyncrl.keys import CONFIG_FIELD, LAST_EVAL_FIELD, LENGTH_BIAS_FIELD, RunKeys
from asyncrl.net import redact_url, url_address
from asyncrl.observe import probe
from asyncrl.observe.metrics import set_figures
from asyncrl.rundir import pid_alive, read_run_info

PING_TIMEOUT_S = 2.0  # a live server on loopback answers in milliseconds; a dead one must not stall us
TOP_REASONS = 5
# Keys that only exist under a run's prefix once the launcher (or a buffer) has touched it.


@dataclass(frozen=True)
class Source:
    """Where a snapshot is read: the server, the run's prefix, and what we know about the run."""

    url: str  # carries the password: never print it, print ``address``
    prefix: str
    state: str  # "running" | "ended" | "unknown" (a bare --redis-url whose processes are silent)
    origin: str  # "live" | "aof-copy"
    run_id: str | None = None
    address: str = ""  # the run's server as host:port (for a copy: the original's), never the password

    def __post_init__(self):
        if not self.address:
            object.__setattr__(self, "address", url_address(self.url))


# ----- finding the run ---------------------------------------------------------------------------


def _read_url(info: dict) -> str | None:
    path = info.get("redis_url_file")
    try:
        return Path(path).read_text().strip() if path else None
    except OSError:
        return None


@contextlib.contextmanager
def open_run(run_dir: Path) -> Iterator[Source]:
    """The run's server if it answers, else a private server on a copy of its append-only file."""
    info = read_run_info(run_dir)
    prefix, run_id = info.get("prefix"), info.get("run_id")
    if not prefix:
        raise UserError(f"{run_dir / 'run.json'} names no Redis prefix")
    url = _read_url(info)
    why = f"cannot read the Redis URL file {info['redis_url_file']}" if info.get("redis_url_file") else "no Redis URL"
    if url:
        try:
            check_redis_url(url, timeout_s=PING_TIMEOUT_S)
        except UserError as exc:
            why = str(exc)
        else:
            yield Source(url, prefix, "running" if pid_alive(info.get("launcher_pid")) else "ended", "live", run_id)
            return
    redis_dir = info.get("redis_dir")
    if not redis_dir or not Path(redis_dir).is_dir():
        raise UserError(f"{why}, and the run at {run_dir} has no Redis data directory to read instead")
    with aof_copy(Path(redis_dir)) as copy_url:
        require_run(copy_url, prefix, f"the append-only file in {redis_dir}")
        address = info.get("redis_address") or url_address(url or copy_url)
        yield Source(copy_url, prefix, "ended", "aof-copy", run_id, address)  # its server is gone: so is the run


@contextlib.contextmanager
def aof_copy(redis_dir: Path) -> Iterator[str]:
    """A private redis-server on a temporary copy of ``redis_dir``; yields its URL, stops it after.

    redis-server loads ``appendonlydir/`` (Redis 7 manifest + files) from ``--dir`` at start-up
    because the copy runs with ``--appendonly yes``; the original directory is only read.
    """
    with tempfile.TemporaryDirectory(prefix="asyncrl-status-") as tmp:
        copy = Path(tmp) / "redis"
        shutil.copytree(redis_dir, copy, ignore=shutil.ignore_patterns("redis.log"))
        server = start_redis_server(copy, appendonly=True)
        try:
            yield server.url
        finally:
            server.stop()


def _client(url: str) -> redis.Redis:
    """Short timeouts and no retries: the caller already saw this server answer PING."""
    return redis.Redis.from_url(
        url, socket_connect_timeout=PING_TIMEOUT_S, socket_timeout=10.0, retry=Retry(NoBackoff(), 0)
    )


def require_run(url: str, prefix: str, where: str) -> None:
    client = _client(url)
    try:
        if not client.exists(*RunKeys(prefix).markers()):
            raise UserError(f"no run with prefix {prefix!r} in {where}")
    finally:
        client.close()


@contextlib.contextmanager
def open_url(url: str, prefix: str | None) -> Iterator[Source]:
    """A server given by URL: its one run, or the run named by ``prefix``."""
    check_redis_url(url, timeout_s=PING_TIMEOUT_S)
    address = url_address(url)
    if prefix is None:
        client = _client(url)
        try:
            prefixes = find_prefixes(client)
        finally:
            client.close()
        if not prefixes:
            raise UserError(f"no asyncrl run found at {address} (no asyncrl:{{<run-id>}}: keys)")
        if len(prefixes) > 1:
            raise UserError(f"{len(prefixes)} runs at {address}: {', '.join(prefixes)}; pick one with --prefix")
        prefix = prefixes[0]
    require_run(url, prefix, address)
    yield Source(url, prefix, "unknown", "live")


# ----- the snapshot ------------------------------------------------------------------------------


def collect_status(source: Source, buffer: RedisBuffer, control: RunControl, now: float | None = None) -> dict:
    """Everything ``asyncrl status`` shows, as JSON-ready data (dict keys are strings).

    ``buffer`` counters are one atomic snapshot (``buffer.stats()``), so ``lost`` is exact; the other
    sections are read just after it, so on a live run they may be a few updates ahead of it.
    """
    now = time.time() if now is None else now
    client = control.r
    version = buffer.get_version()
    stats = buffer.stats()
    state = source.state if source.state != "unknown" else _state_from_redis(control)
    counters = {k: stats[k] for k in STAT_KEYS}
    meta = {k.decode(): v.decode(errors="replace") for k, v in client.hgetall(control.keys.meta).items()}
    meta.pop(CONFIG_FIELD, None)  # the whole config: it is in the run directory
    last_eval = meta.pop(LAST_EVAL_FIELD, None)
    length_bias = meta.pop(LENGTH_BIAS_FIELD, None)
    return {
        "run_id": source.run_id,
        "prefix": source.prefix,
        "redis": source.address,
        "source": source.origin,
        "state": state,
        "version": version,
        "meta": meta,
        "last_eval": json.loads(last_eval) if last_eval else None,  # the newest evaluation's record
        "length_bias": json.loads(length_bias) if length_bias else None,  # the launcher's, as in summary.json
        "fleet": [] if state == "ended" else control.members("generator"),
        "buffer": {
            **counters,
            "lost": lost_groups(stats),
            "unfinished": unfinished_groups(stats),
            "orphans": buffer.orphans(),  # unfinished, their generator dead: the next with room resumes them
            "live": live_groups(stats),
            "stream_length": int(client.xlen(control.keys.traj)),
        },
        "consumers": consumers(client, control.keys.traj, idle_known=source.origin == "live"),
        "dead_letters": dead_letter_summary(buffer, stats["dead"]),
        "staleness": {str(k): v for k, v in sorted(control.staleness_histogram().items())},
        "weight_sync": probe.read_health(control),  # the probe: learner vs every generator's engine
        "generators": processes(control, "generator", version, now, ended=state == "ended"),
        "learners": processes(control, "learner", version, now, ended=state == "ended"),
    }


def _state_from_redis(control: RunControl) -> str:
    """Without a launcher pid: a stop request means ended, a live heartbeat means running."""
    if control.stop_requested():
        return "ended"
    if control.heartbeats("learner") or control.heartbeats("generator"):
        return "running"
    return "unknown"


def _by_name(name: str) -> tuple[int, str]:
    return len(name), name  # rank2 before rank10; generator 2 before 10


def consumers(client: redis.Redis, stream: str, idle_known: bool) -> dict[str, dict]:
    """Per learner rank (consumer ``rank<r>``): entries delivered but not acknowledged, and idle time
    (None from an AOF copy: loading it resets every consumer's idle time)."""
    try:
        rows = client.xinfo_consumers(stream, GROUP)
    except redis.ResponseError:  # no stream or no consumer group yet
        return {}
    out = {}
    for row in rows:
        name = row["name"].decode() if isinstance(row["name"], bytes) else str(row["name"])
        out[name] = {"pending": int(row["pending"]), "idle_ms": int(row["idle"]) if idle_known else None}
    return {name: out[name] for name in sorted(out, key=_by_name)}


def dead_letter_summary(buffer: RedisBuffer, total: int) -> dict:
    """``total`` counts every dead letter; reasons come from the ones the stream still keeps."""
    letters = buffer.dead_letters(DEAD_MAX_ENTRIES)
    reasons = Counter(d.reason for d in letters)
    top = []
    for reason, n in reasons.most_common(TOP_REASONS):
        producers = Counter(d.producer for d in letters if d.reason == reason)
        top.append({"reason": reason, "count": n, "producers": dict(producers.most_common())})
    return {"total": total, "kept": len(letters), "top_reasons": top}


def processes(control: RunControl, role: str, version: int, now: float, ended: bool) -> dict[str, dict]:
    """Every process of ``role`` ever seen, with its last heartbeat; ``alive``: its heartbeat has not
    expired (learners 30 s, generators their lease, 10 s) and the run has not ended. ``lag`` = learner
    version - version it serves."""
    live = control.heartbeats(role)
    seen = control.seen(role)
    out = {}
    for ident in sorted(set(seen) | set(live), key=_by_name):
        beat = seen.get(ident) or live[ident]
        served = beat.get("version")
        served = None if served is None else int(served)
        out[ident] = {
            "alive": ident in live and not ended,
            "age_s": round(now - float(beat["time"]), 1) if "time" in beat else None,
            "version": served,
            "lag": None if served is None else version - served,
            "pid": None if beat.get("pid") is None else int(beat["pid"]),
        }
    return out


def status(run: Path | None = None, redis_url: str | None = None, prefix: str | None = None) -> dict:
    """The snapshot of the run in ``run`` (a run directory) or at ``redis_url``; UserError if none."""
    opener = open_run(Path(run)) if run is not None else open_url(redis_url, prefix)
    with opener as source:
        buffer = RedisBuffer(source.url, source.prefix, retries=1)
        client = _client(source.url)
        try:
            return collect_status(source, buffer, RunControl(client, source.prefix))
        except (redis.RedisError, BufferUnavailableError) as exc:
            message = str(exc).replace(source.url, redact_url(source.url))
            raise UserError(f"lost Redis at {source.address} while reading: {message}") from None
        finally:
            buffer.close()
            client.close()


# ----- rendering ---------------------------------------------------------------------------------


def _pairs(d: dict, keys: tuple[str, ...]) -> str:
    return "  ".join(f"{k} [bold]{d[k]}[/]" for k in keys)


def render(st: dict, console) -> None:
    """Tables for a terminal (rich): every counter of ``--json`` (a test holds it to that), but the
    metadata's weight-sync probe arrays (``probe:<v>``, 64 log-probs each), which only ``--json`` prints."""
    from rich.table import Table

    state = {"running": "[green]running[/]", "ended": "[yellow]ended[/]"}.get(st["state"], st["state"])
    via = " (from a copy of its append-only file)" if st["source"] == "aof-copy" else ""
    console.print(f"[bold]{st['run_id'] or st['prefix']}[/] on {st['redis']}{via}: {state}, version {st['version']}")
    _render_meta(st["meta"], console)
    b = st["buffer"]
    lost = f"lost [bold red]{b['lost']}[/]" if b["lost"] else "lost [bold]0[/]"
    table = Table(title="buffer", show_header=False, title_justify="left")
    for label, keys in _BUFFER_ROWS:
        table.add_row(label, _pairs(b, keys) + ("  " + lost if label == "in stream" else ""))
    shown = {k for _, keys in _BUFFER_ROWS for k in keys} | {"lost"}
    rest = tuple(k for k in b if k not in shown)  # a counter added later is never hidden
    if rest:
        table.add_row("other", _pairs(b, rest))
    console.print(table)
    console.print(f"fleet: [bold]{len(st['fleet'])}[/] generators live ({', '.join(st['fleet']) or '-'})")
    stale = "  ".join(f"{k} behind: [bold]{v}[/]" for k, v in st["staleness"].items()) or "-"
    console.print(f"staleness of trained groups: {stale}")
    _render_eval(st.get("last_eval"), console)
    _render_lengths(st.get("length_bias"), console)
    _render_sync(st.get("weight_sync"), console)
    _render_consumers(st["consumers"], console, Table)
    _render_processes(st, console, Table)
    _render_dead(st["dead_letters"], b["foreign"], console, Table)


_BUFFER_ROWS = (
    ("admission", ("started", "replayed", "abandoned", "failed", "unfinished", "live")),
    ("resuming", ("orphans", "resumed")),  # groups of dead generators (asyncrl.generators.journal)
    ("pushes", ("pushed", "duplicates")),
    ("outcomes", ("trained", "dropped_stale", "filtered", "dead")),
    ("in stream", ("queued", "pending", "stream_length")),  # + lost, in red when not 0
    # entries push() never appended: dead-lettered unread, counted apart from the groups' outcomes
    ("foreign", ("foreign", "foreign_in_buffer")),
)


def _render_meta(meta: dict, console) -> None:
    """The run's metadata on one line, the probe's fields left out (its figure has a line of its own)."""
    shown = "  ".join(f"{k}={v}" for k, v in sorted(meta.items()) if not probe.is_probe_field(k))
    if any(probe.is_probe_field(k) for k in meta):
        shown += f"{'  ' if shown else ''}(the weight-sync probe's log-probs: see --json)"
    if shown:
        console.print("meta: " + shown)


def _render_eval(record: dict | None, console) -> None:
    """The newest evaluation: the bar's reward, and each named set's figures on a line of its own."""
    if not record or "eval/version" not in record:
        return
    bar = record.get("eval/reward_mean")
    shown = "every episode failed" if bar is None else f"reward [bold]{bar:.3f}[/]"
    console.print(f"eval at version {record['eval/version']}: {shown}")
    for name, figures in set_figures(record).items():
        mark = " (the bar)" if name == record.get("eval/bar") else ""
        console.print(f"  {name}{mark}: " + "  ".join(f"{m} [bold]{v:.3f}[/]" for m, v in figures.items()))


def _render_lengths(bias: dict | None, console) -> None:
    """Model tokens a sample, generated against trained and dropped as stale (means, medians, 90th percentiles),
    and how far apart trained and generated are: the length bias of dropping stale work."""
    if not bias or not bias.get("generated_samples"):
        return
    kinds = []
    for kind in ("generated", "trained", "dropped_stale"):
        if bias.get(f"{kind}_samples"):
            mean = bias[f"{kind}_tokens_per_sample"]
            kinds.append(f"{kind.replace('_', ' ')} {_dash(mean and round(mean, 1))} (median {bias[f'{kind}_p50']}, "
                         f"p90 {bias[f'{kind}_p90']}; {bias[f'{kind}_samples']} samples)")  # fmt: skip
    ratio, ks = bias.get("trained_over_generated"), bias.get("ks_trained_vs_generated")
    apart = f"trained/generated [bold]{_dash(ratio and round(ratio, 3))}[/], KS [bold]{_dash(ks and round(ks, 3))}[/]"
    console.print(f"lengths (model tokens a sample): {apart}; " + "; ".join(kinds))


def _render_sync(sync: dict | None, console) -> None:
    if not sync:  # a snapshot of an older asyncrl
        return
    worst, versions = sync["probe_logprob_diff_max"], list(sync["versions"])
    if worst is None:
        console.print("weight sync (probe): no generator has compared a version yet")
        return
    span = versions[0] if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"
    figure = f"largest |generator - learner| log-prob [bold]{worst:.3g}[/]"
    console.print(f"weight sync (probe): {figure} at versions {span}")
    if broken := sync.get("broken"):  # beyond the numerics gap: an engine nearer the version before
        worst = min(broken, key=broken.get)
        console.print(
            f"[bold red]weight sync broken or stale[/] at versions {', '.join(broken)}: an engine's log-probs sit "
            f"{broken[worst]:.2f} of the way from version {int(worst) - 1} to {worst}"
        )


def _render_consumers(rows: dict, console, Table) -> None:
    table = Table("learner consumer", "pending", "idle", title="consumers", title_justify="left")
    for name, row in rows.items():
        idle = "-" if row["idle_ms"] is None else f"{row['idle_ms'] / 1000:.1f} s"
        table.add_row(name, str(row["pending"]), idle)
    console.print(table)


def _render_processes(st: dict, console, Table) -> None:
    table = Table(
        "process", "alive", "version", "lag", "last heartbeat", "pid", title="processes", title_justify="left"
    )
    for role in ("learners", "generators"):
        for ident, p in st[role].items():
            alive = "[green]yes[/]" if p["alive"] else "[red]no[/]"
            age = "-" if p["age_s"] is None else f"{p['age_s']:.1f} s ago"
            table.add_row(f"{role[:-1]}-{ident}", alive, _dash(p["version"]), _dash(p["lag"]), age, _dash(p["pid"]))
    console.print(table)


def _render_dead(dead: dict, foreign: int, console, Table) -> None:
    """``total`` counts dead-lettered groups; the stream also keeps the foreign entries dead-lettered
    unread (counted as ``foreign``), so ``kept`` may exceed it; the reasons are those of the kept ones."""
    title = f"dead letters: {dead['total']} groups + {foreign} foreign entries, kept {dead['kept']}"
    console.print(title)  # its own line: a table's title wraps at the table's width
    if not dead["top_reasons"]:
        return
    table = Table("reason", "count", "producers")
    for row in dead["top_reasons"]:
        producers = ", ".join(f"{p} ({n})" for p, n in row["producers"].items())
        table.add_row(row["reason"], str(row["count"]), producers)
    console.print(table)


def _dash(x) -> str:
    return "-" if x is None else str(x)

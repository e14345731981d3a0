"""A private ``redis-server`` for one run, and a reachability check for an external one.

The launcher starts one server per run when no ``--redis-url`` is given: loopback only, protected
mode, a generated password, append-only file in the run directory with ``appendfsync always``: a
write is on disk before its reply is sent, so neither a killed server nor a crashed machine loses
anything a client saw acknowledged. (``everysec`` is not enough even for a killed process: while a
background fsync runs, redis-server delays its AOF writes by up to 2 s but still replies; the
property test in ``tests/buffers/test_buffer_model.py`` lost acknowledged pushes that way in 1 run of 4.)
The password is handed to redis-server on stdin, never on its command line, so ``ps`` does not show
it. The server runs in its own session so a Ctrl-C in the terminal reaches the launcher, which then
stops the server last, after learners and generators are done with it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from asyncrl.errors import UserError
from asyncrl.net import redact_url, url_address

REDIS_BINARY = "redis-server"
INSTALL_HINT = (
    "install it with `apt-get install redis-server` (Debian/Ubuntu), `brew install redis` (macOS) "
    "or `conda install -c conda-forge redis-server`, or pass --redis-url to use a running server"
)
_LOG_NAME = "redis.log"
# Times a start is retried when the free port we picked was taken before redis-server bound it.
_PORT_ATTEMPTS = 3


URL_FORMS = "redis://[:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) or unix:///PATH"


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is not a Redis URL (scheme, host, port, database number), or None; asks no server."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        return f"it has {f'the scheme {parts.scheme}://' if parts.scheme else 'no scheme'}"
    if parts.scheme == "unix":
        return None if parts.path else "it names no socket path"
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return f"its port {parts.netloc.rpartition(':')[2]!r} is not a number in 0..65535"
    if not parts.hostname:
        return "it names no host"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"its database {db!r} is not a number"
    return None


def shown_url(url: str) -> str:
    """``url`` without its password, also when it is not a well-formed URL."""
    try:
        return redact_url(url)
    except ValueError:  # a port that is not a number
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def check_redis_url(url: str, timeout_s: float = 3.0) -> None:
    """PING the server at ``url``; raise :class:`UserError` saying why it cannot be used: first whether
    it is a Redis URL at all, then whether the server answers."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    problem = redis_url_problem(url)
    if problem:
        raise UserError(f"{shown_url(url)!r} is not a Redis URL ({problem}); use {URL_FORMS}")
    address = url_address(url)
    password = urlsplit(url).password
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if password:
            reason = reason.replace(password, "***")
        raise UserError(f"cannot reach Redis at {address}: {reason}") from None


class RedisServer:
    """A running ``redis-server`` child process. Stop it with :meth:`stop` (also on ``with`` exit)."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        password: str,
        appendonly: bool,
        binary: str,
        preexec_fn=None,
        host: str | None = None,
    ) -> None:
        self.preexec_fn = preexec_fn  # run in the child before exec (the launcher's: die with it)
        self.host = host  # listened on besides loopback (other hosts' processes reach it there)
        self.workdir = Path(workdir)
        self.port = port
        self.password = password
        self.appendonly = appendonly
        self._binary = binary
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / _LOG_NAME

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        return f"RedisServer(url={redact_url(self.url)!r}, pid={self.pid}, dir={str(self.workdir)!r})"

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- lifecycle --------------------------------------------------------------------------

    def _spawn(self) -> None:
        # Everything but the password on the command line; the password on stdin ("-": read config
        # from stdin, then apply the command-line options).
        args = [
            self._binary, "-",
            "--port", str(self.port),
            "--bind", "127.0.0.1", *([self.host] if self.host else []),
            "--protected-mode", "yes",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            "--save", "",  # no RDB snapshots: the AOF is the durability mechanism (one fork less)
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # early errors (before --logfile applies) go here too
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self.preexec_fn,
            )
        finally:
            log.close()
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
            self._proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited at once; _wait_ready reports that with the log

    def _wait_ready(self, timeout_s: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),  # this loop is the retry
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise _ServerExited(f"redis-server exited with code {code} during start-up")
                try:
                    if client.ping():
                        return
                except redis.AuthenticationError:
                    raise  # another server owns this port
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise UserError(
                        f"redis-server did not answer PING on 127.0.0.1:{self.port} within {timeout_s:.0f}s; "
                        f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (if not running) and return once it answers PING."""
        if self.is_running():
            return
        self._spawn()
        try:
            self._wait_ready(timeout_s)
        except Exception:
            self.kill()
            raise

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stop (if running) and start again on the same port, password and directory."""
        import redis

        self.stop()
        try:
            self.start(timeout_s)
        except (_ServerExited, redis.AuthenticationError) as exc:
            raise UserError(f"{exc}; its log ({self.log_path}) ends with:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (redis flushes the AOF and exits), wait; SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, no flush (a crash, as tests simulate it)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self._proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class _ServerExited(Exception):
    pass


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the caller binds it, or retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_binary(binary: str = REDIS_BINARY) -> str:
    """The path of ``binary``; UserError saying how to install it if it is not on PATH."""
    exe = shutil.which(binary)
    if exe is None:
        raise UserError(f"{binary} not found on PATH; {INSTALL_HINT}")
    return exe


def start_redis_server(
    workdir: Path,
    password: str | None = None,
    appendonly: bool = True,
    *,
    host: str | None = None,
    port: int = 0,
    binary: str = REDIS_BINARY,
    timeout_s: float = 10.0,
    preexec_fn=None,
) -> RedisServer:
    """Start ``redis-server`` on a free loopback port (or ``port``) with data in ``workdir``; wait until
    it answers. ``host``: an address of this machine to listen on as well, for other hosts' clients.

    Raises :class:`UserError` if the binary is missing, or the server exits or stays silent during
    start-up (the message carries the end of its log).
    """
    exe = find_redis_binary(binary)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    password = password or secrets.token_hex(24)
    if any(c in password for c in '"\\\n\r'):
        raise UserError("the Redis password must not contain quotes, backslashes or newlines")
    import redis

    for attempt in range(_PORT_ATTEMPTS):
        server = RedisServer(workdir, port or free_loopback_port(), password, appendonly, exe, preexec_fn, host)
        try:
            server.start(timeout_s)
            return server
        except (_ServerExited, redis.AuthenticationError) as exc:
            # Most likely the port was taken between picking and binding it; pick another.
            if attempt == _PORT_ATTEMPTS - 1 or port:
                raise UserError(f"{exc}; its log ({server.log_path}) ends with:\n{server.log_tail()}") from None
    raise AssertionError("unreachable")

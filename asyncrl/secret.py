"""The run secret: one random value per run, from which every credential of the run derives.

Whoever holds it can join the run; whoever does not can neither reach its Redis server (the password
is derived from it) nor publish or read its weights (the weight bus's CURVE keys are derived from it).
It travels only in the environment (``ASYNCRL_SECRET``) or in a file readable by its owner alone
(``runs/<name>/secret``, mode 0600), never in a process's arguments, a log line or Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from asyncrl.errors import UserError

ENV = "ASYNCRL_SECRET"
_FORMAT = re.compile(r"^[0-9a-f]{64}$")


def new_secret() -> str:
    """256 random bits, as 64 lowercase hex digits."""
    return secrets.token_hex(32)


def check_secret(secret: str, source: str) -> str:
    secret = secret.strip()
    if not _FORMAT.match(secret):
        raise UserError(f"the run secret from {source} is not 64 hex digits (make one with `asyncrl secret`)")
    return secret


def read_secret(path: str | Path | None = None) -> str | None:
    """The secret from ``path`` (a file only its owner may read), else from ``$ASYNCRL_SECRET``, else None."""
    if path is not None:
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UserError(f"secret file {path} does not exist") from None
        if mode & 0o077:
            raise UserError(f"secret file {path} is readable by others: chmod 600 {path}")
        return check_secret(path.read_text(), str(path))
    value = os.environ.get(ENV)
    return check_secret(value, f"${ENV}") if value else None


def derive(secret: str, purpose: str) -> bytes:
    """32 bytes for one ``purpose`` (HMAC-SHA256): knowing one derived value reveals neither the
    secret nor any other."""
    return hmac.new(bytes.fromhex(secret), purpose.encode(), hashlib.sha256).digest()


def redis_password(secret: str) -> str:
    return derive(secret, "redis-password").hex()


def write_secret(path: Path, text: str, newline: bool = True) -> Path:
    """Write ``text`` readable by this user only (the Redis URL carries its password)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + ("\n" if newline else ""))
    return path

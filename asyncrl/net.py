"""Addresses: which are loopback, which of this host's addresses faces another host, URLs shown without
their credentials, and the back-off every retrying client uses (the Redis buffer, the remote reward)."""

from __future__ import annotations

import ipaddress
import random
import socket
from urllib.parse import urlsplit, urlunsplit


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and every 127.0.0.0/8 and ::1 address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_to(host: str) -> str:
    """This host's address on the route to ``host`` (the one the peer sees; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds the IPv4 ``address`` (gloo binds by name)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    raise LookupError(f"no network interface of this host has the address {address}")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def url_address(url: str) -> str:
    """``host:port`` (or the socket path) of a Redis URL, without credentials."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Sleep before retry number ``attempt``: "equal jitter" exponential back-off.

    Half of ``min(cap, base * 2**attempt)`` is fixed, so the retries together always wait at least
    about half their nominal sum (the buffer's 0.1 s base, 2 s cap, 6 retries: 3.5 to 7 s, which rides
    through a server restart); the random half keeps many clients from reconnecting in lockstep.
    """
    t = min(cap_s, base_s * 2**attempt) / 2
    return t + random.uniform(0, t)

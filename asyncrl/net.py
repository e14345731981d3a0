"""Addresses: which are loopback, and which of this host's addresses faces another host."""

from __future__ import annotations

import ipaddress
import socket


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

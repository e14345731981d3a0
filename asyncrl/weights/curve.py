"""CURVE authentication and encryption of the ZeroMQ weight bus, keyed by the run secret.

Both key pairs derive from the secret (``asyncrl.secret.derive``), so nothing but the secret has to
be distributed: the server pair (publisher and every relay) and the client pair (every subscriber
connection). A server socket accepts only connections that present the client public key of its
secret (checked by a ZAP handler, one per ZeroMQ context, serving every secret in the process under a
ZAP domain of its own); a client socket talks only to a server that proves it holds the server
secret key. So without the secret a peer can neither read the weights nor feed a subscriber.

What is protected where: ``tcp://`` endpoints with a secret are authenticated and encrypted (CURVE);
``ipc://`` endpoints are never encrypted, since they live in a 0700 directory that only the run's
user can reach (``private_address``), and tcp without a secret is open to whoever can connect (the
default binds loopback only). Keys are never logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading

import zmq
import zmq.auth.thread

from asyncrl.secret import derive

_AUTH: dict[tuple[int, int], zmq.auth.thread.ThreadAuthenticator] = {}  # (pid, id(context)) -> ZAP handler
_AUTH_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """The run's two CURVE key pairs (z85 bytes); ``domain`` names its ZAP domain."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def domain(self) -> str:
        return "asyncrl-" + hashlib.sha256(self.server_public).hexdigest()[:16]

    def __repr__(self) -> str:  # never print the secret keys
        return f"CurveKeys(domain={self.domain})"


def _pair(secret: str, purpose: str) -> tuple[bytes, bytes]:
    private = zmq.utils.z85.encode(derive(secret, purpose))
    return zmq.curve_public(private), private


def curve_keys(secret: str | None, address: str) -> CurveKeys | None:
    """The keys for ``address``: None without a secret or for a non-tcp endpoint (see module doc)."""
    if not secret or not address.startswith("tcp://"):
        return None
    server_public, server_secret = _pair(secret, "weights-curve-server")
    client_public, client_secret = _pair(secret, "weights-curve-client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


class _AllowOne:
    """A ZAP credentials provider: the one client public key of the domain's secret."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


def _authenticator(context: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator:
    """The context's ZAP handler, started on first use; it lives as long as the process."""
    with _AUTH_LOCK:
        key = (os.getpid(), id(context))  # a forked child's context may reuse a dead one's id
        auth = _AUTH.get(key)
        if auth is None:
            quiet = logging.getLogger("asyncrl.weights.zap")  # its debug lines name client keys
            quiet.setLevel(logging.WARNING)
            auth = zmq.auth.thread.ThreadAuthenticator(context, log=quiet)
            auth.start()
            _AUTH[key] = auth
        return auth


def make_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Before bind: ``sock`` accepts only clients that hold the secret of ``keys``."""
    if keys is None:
        return
    _authenticator(sock.context).configure_curve_callback(keys.domain, _AllowOne(keys.client_public))
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler for the domain: refuse, never admit
    sock.setsockopt_string(zmq.ZAP_DOMAIN, keys.domain)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Before connect: ``sock`` talks only to a server that holds the secret of ``keys``."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret

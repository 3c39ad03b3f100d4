"""Authenticated, encrypted ZeroMQ for every socket kvroute owns.

A process states once, at start, how it speaks (``configure``): with a cluster key folder
(CURVE: every frame encrypted, and only the cluster's two role keys accepted) or, asked
for explicitly, in clear (``--insecure-no-auth``). Each socket is then made a server
(``secure_server``, before it binds) or a client of a role's server (``secure_client``,
before it connects). A socket made before ``configure`` raises, so no socket is ever left
in clear by omission.

CURVE is libzmq's own; who may connect is decided by a ZAP handler, one thread per libzmq
context, started with the context's first server socket. It accepts the two role keys
and names the peer's role as the ZeroMQ ``User-Id`` of each frame it sends
(``peer_role``), so a server can refuse one role what it allows another. A peer with
another key gets no reply and costs one warning per address per minute.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from foundation.cluster_keys import ClusterKeyError, ClusterKeys, load

logger = logging.getLogger("kvroute.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
ZAP_VERSION = b"1.0"
DENIED_WARNING_INTERVAL = 60.0  # seconds between warnings about one address
DOMAIN = b"kvroute"


class NotConfigured(RuntimeError):
    pass


@dataclass(frozen=True)
class Security:
    keys: ClusterKeys | None  # None: sockets in clear
    identity: str  # the role whose key this process presents as a client
    # The transfer endpoint and links (KV bytes) under CURVE too; off: in clear and open to
    # anyone who reaches them, for fabrics nobody else can reach (docs/security.md).
    transfer_encryption: bool = True

    @property
    def enabled(self) -> bool:
        return self.keys is not None


_security: Security | None = None


def configure(keys: ClusterKeys | None, identity: str, transfer_encryption: bool = True) -> Security:
    """How this process's sockets speak; call once at start, before any socket exists."""
    global _security
    if keys is not None:
        keys.secret(identity)  # fail at start, not at the first connect
        if not transfer_encryption:
            logger.warning("transfer encryption is OFF (--transfer-encryption off): KV bytes cross the "
                           "network in clear and the transfer endpoints accept any peer that reaches them")
    elif _security is None or _security.enabled:
        logger.warning("ZeroMQ authentication is OFF (--insecure-no-auth): anyone who can reach this "
                       "process's ports can register workers, read prompts and move KV. Use it only on a "
                       "network nobody else can reach.")
    _security = Security(keys, identity, transfer_encryption)
    return _security


def configure_from_flags(cluster_keys: str, insecure_no_auth: bool, identity: str,
                         transfer_encryption: bool = True) -> Security:
    """``configure`` from a process's flags: exactly one of a key folder and the explicit
    ``--insecure-no-auth``."""
    if cluster_keys and insecure_no_auth:
        raise ClusterKeyError("--cluster-keys and --insecure-no-auth exclude each other")
    if not cluster_keys and not insecure_no_auth:
        raise ClusterKeyError("no cluster keys: start with --cluster-keys DIR (create the folder with "
                              "`kvroute keys init DIR`; env KVROUTE_CLUSTER_KEYS) or, on a network nobody "
                              "else can reach, --insecure-no-auth")
    return configure(None if insecure_no_auth else load(cluster_keys), identity, transfer_encryption)


def _environment() -> tuple[str, bool, str]:
    """The key folder, ``--insecure-no-auth`` and ``--transfer-encryption`` the environment
    gives (``KVROUTE_CLUSTER_KEYS``, ``KVROUTE_INSECURE_NO_AUTH``, ``KVROUTE_TRANSFER_ENCRYPTION``),
    read alike for flags' defaults and for processes without flags."""
    insecure = os.environ.get("KVROUTE_INSECURE_NO_AUTH", "").strip().lower() in ("1", "true", "yes", "on")
    return os.environ.get("KVROUTE_CLUSTER_KEYS", ""), insecure, os.environ.get("KVROUTE_TRANSFER_ENCRYPTION", "on")


def configure_from_environment(identity: str) -> Security:
    """``configure`` from the environment alone: for helper processes that take no flags (a
    spawned child, a benchmark's in-process servers)."""
    keys, insecure, encryption = _environment()
    return configure_from_flags(keys, insecure, identity, encryption != "off")


def add_security_arguments(parser) -> None:
    """The flags of every process that speaks ZeroMQ (orchestrator, workers)."""
    keys, insecure, encryption = _environment()
    parser.add_argument("--cluster-keys", default=keys,
                        help="the cluster's key folder (`kvroute keys init DIR`): every ZeroMQ socket is "
                             "authenticated and encrypted with it (env KVROUTE_CLUSTER_KEYS)")
    parser.add_argument("--insecure-no-auth", action="store_true", default=insecure,
                        help="no cluster keys: ZeroMQ sockets in clear, open to anyone who reaches them; "
                             "only on a network nobody else can reach (env KVROUTE_INSECURE_NO_AUTH)")
    parser.add_argument("--transfer-encryption", choices=("on", "off"), default=encryption,
                        help="off: KV bytes travel in clear and transfer endpoints accept any peer, for fabrics "
                             "nobody else can reach (CURVE costs ~4x on loopback bulk copies; the same-host "
                             "shared-memory path is unaffected); set it alike on every process of the cluster "
                             "(default: %(default)s; env KVROUTE_TRANSFER_ENCRYPTION)")


def current() -> Security:
    if _security is None:
        raise NotConfigured("ZeroMQ security is not configured: start with --cluster-keys DIR "
                            "(`kvroute keys init DIR`) or --insecure-no-auth")
    return _security


def secure_server(socket: zmq.Socket, role: str, transfer: bool = False) -> zmq.Socket:
    """Make ``socket`` (not yet bound) a CURVE server presenting ``role``'s key.
    ``transfer``: a socket that carries KV bytes (see ``Security.transfer_encryption``)."""
    security = current()
    if not _encrypts(security, transfer):
        return socket
    _ensure_authenticator(socket.context, security.keys)
    socket.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    socket.curve_secretkey = security.keys.secret(role)
    socket.curve_publickey = security.keys.public(role)
    socket.curve_server = True
    return socket


def secure_client(socket: zmq.Socket, server_role: str, transfer: bool = False) -> zmq.Socket:
    """Make ``socket`` (not yet connected) a CURVE client of a ``server_role`` server."""
    security = current()
    if not _encrypts(security, transfer):
        return socket
    socket.curve_serverkey = security.keys.public(server_role)
    socket.curve_publickey = security.keys.public(security.identity)
    socket.curve_secretkey = security.keys.secret(security.identity)
    return socket


def encrypts_kv() -> bool:
    """Whether this process's transfer sockets encrypt KV bytes; True where nothing is
    configured yet, so what asks errs towards keeping KV secret."""
    return _security is None or _encrypts(_security, transfer=True)


def _encrypts(security: Security, transfer: bool) -> bool:
    return security.keys is not None and (security.transfer_encryption or not transfer)


def peer_role(frame: zmq.Frame) -> str | None:
    """The role of the peer that sent ``frame`` (received with ``copy=False``); None in clear."""
    if not current().enabled:
        return None
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


_authenticators: dict[int, _ZapHandler] = {}
_authenticators_lock = threading.Lock()


def _ensure_authenticator(context: zmq.Context, keys: ClusterKeys) -> None:
    with _authenticators_lock:
        handler = _authenticators.get(context.underlying)
        if handler is None or not handler.is_alive():
            handler = _ZapHandler(zmq.Context.shadow(context.underlying), keys)
            handler.start()
            handler.ready.wait(10)
            _authenticators[context.underlying] = handler


class _ZapHandler(threading.Thread):
    """Answers libzmq's authentication requests for one context until the context ends."""

    def __init__(self, context: zmq.Context, keys: ClusterKeys):
        super().__init__(name="kvroute-zap", daemon=True)
        self._context = context
        self._keys = keys
        self._last_warning: dict[str, float] = {}
        self.ready = threading.Event()

    def run(self) -> None:
        socket = self._context.socket(zmq.REP)
        socket.linger = 0
        try:
            socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as error:
            logger.error("cannot start ZeroMQ authentication: %s", error)
            socket.close()
            return
        self.ready.set()
        try:
            while True:
                request = socket.recv_multipart()
                socket.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [ZAP_VERSION, request[1] if len(request) > 1 else b"", b"400", b"malformed", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        peer = address.decode(errors="replace")
        role = None
        if version == ZAP_VERSION and mechanism == b"CURVE" and len(credentials) == 1:
            role = self._keys.role_of(z85.encode(credentials[0]))
        if role is None:
            self._warn_denied(peer, mechanism.decode(errors="replace"))
            return [ZAP_VERSION, request_id, b"400", b"not a member of this cluster", b"", b""]
        return [ZAP_VERSION, request_id, b"200", b"OK", role.encode(), b""]

    def _warn_denied(self, peer: str, mechanism: str) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(peer, -DENIED_WARNING_INTERVAL) < DENIED_WARNING_INTERVAL:
            return
        if len(self._last_warning) > 10_000:  # a flood of addresses must not grow this forever
            self._last_warning.clear()
        self._last_warning[peer] = now
        logger.warning("refused a ZeroMQ peer at %s: its %s key is not one of this cluster's "
                       "(further refusals of this address are not logged for %.0f s)",
                       peer, mechanism, DENIED_WARNING_INTERVAL)

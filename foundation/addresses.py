"""Checking an address a peer gave us before any socket connects to it.

Workers tell orchestrators where to reach them (their RPC, KV-event and transfer
endpoints) in heartbeats. libzmq raises on a malformed endpoint, and accepts forms a
worker never advertises (``tcp://src;dst`` picks a source interface, ``tcp://*:*``
means "any"), so every such address is checked here first: a scheme kvroute uses, a
host, a port in range, a bounded length, nothing unprintable.
"""

from __future__ import annotations

import ipaddress
import re

MAX_ADDRESS_LENGTH = 256  # far above any real endpoint; bounds what a log line or a label can carry
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                        r"[A-Za-z0-9])?)*\.?$")


class AddressError(ValueError):
    """An address no kvroute socket may connect to."""


def check_peer_address(address: str, what: str = "address") -> None:
    """``address`` is ``tcp://HOST:PORT`` (host a name, IPv4, or [IPv6]; port 1-65535) or
    ``ipc:///absolute/path``; raises AddressError saying what is wrong otherwise."""
    if not isinstance(address, str) or not address:
        raise AddressError(f"{what} is empty")
    if len(address) > MAX_ADDRESS_LENGTH:
        raise AddressError(f"{what} is longer than {MAX_ADDRESS_LENGTH} characters")
    if not address.isascii() or not address.isprintable():
        raise AddressError(f"{what} has characters outside printable ASCII")
    scheme, separator, rest = address.partition("://")
    if not separator or scheme not in ("tcp", "ipc"):
        raise AddressError(f"{what} {address!r} is not tcp://HOST:PORT or ipc:///PATH")
    if scheme == "ipc":
        _check_ipc_path(rest, what)
    else:
        host, colon, port = rest.rpartition(":")
        if not colon:
            raise AddressError(f"{what} {address!r} has no port")
        check_host(host, what)
        _check_port(port, what)


def check_host(host: str, what: str = "host") -> None:
    """A host a peer can connect to: a DNS name, an IPv4 address or a bracketed IPv6 one,
    never a wildcard (``*``, 0.0.0.0, ::)."""
    if host.startswith("[") and host.endswith("]"):
        _check_ip(host[1:-1], what)
    elif _looks_like_ipv4(host):
        _check_ip(host, what)
    elif not _HOST_NAME.match(host):
        raise AddressError(f"{what} has no valid host (got {host!r})")


def _looks_like_ipv4(host: str) -> bool:
    return bool(host) and all(part.isdigit() for part in host.split("."))


def _check_ip(text: str, what: str) -> None:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise AddressError(f"{what} has no valid IP address (got {text!r})") from None
    if ip.is_unspecified:
        raise AddressError(f"{what} names the wildcard address {text}, which no peer can connect to")


def _check_port(port: str, what: str) -> None:
    if not (port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        raise AddressError(f"{what} has no port in 1-65535 (got {port!r})")


def _check_ipc_path(path: str, what: str) -> None:
    if not path.startswith("/") or path == "/" or "\0" in path:
        raise AddressError(f"{what} has no absolute ipc path (got {path!r})")

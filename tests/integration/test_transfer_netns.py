"""The shaped link of ``kvroute bench transfer``: two namespaces, a veth pair with addresses
only inside them, tbf on both ends, and nothing left behind on exit or on error.

Needs root and iproute2; skipped elsewhere. The rate arithmetic is in
tests/unit/test_transfer_netns_rates.py.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys

import pytest

from kvroute.bench.transfer_netns import (
    RECEIVER_ADDRESS,
    SENDER_ADDRESS,
    ShapedLink,
    enter_namespace,
    shaping_available,
)

ECHO_SERVER = f"""
import socket
server = socket.create_server(("{RECEIVER_ADDRESS}", 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
connection.sendall(connection.recv(16))
"""


def inside(namespace: str, *command: str) -> str:
    return subprocess.run(("ip", "netns", "exec", namespace, *command), capture_output=True, text=True,
                          check=True).stdout


def echo_from(namespace: str, port: int, result) -> None:
    """Child process main: join ``namespace`` and talk to the receiver's echo server."""
    enter_namespace(namespace)
    with socket.create_connection((RECEIVER_ADDRESS, port), timeout=10) as connection:
        connection.sendall(b"across")
        result.put(connection.recv(16))


def echo_across(link: ShapedLink) -> bytes:
    server = subprocess.Popen(("ip", "netns", "exec", link.receiver_namespace, sys.executable, "-c", ECHO_SERVER),
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        spawn = multiprocessing.get_context("spawn")
        result = spawn.Queue()
        client = spawn.Process(target=echo_from, args=(link.sender_namespace, port, result))
        client.start()
        client.join(30)
        return result.get(timeout=5)
    finally:
        server.kill()
        server.wait()


def namespaces() -> str:
    return subprocess.run(("ip", "netns", "list"), capture_output=True, text=True).stdout


needs_root = pytest.mark.skipif(shaping_available() is not None, reason=str(shaping_available()))


@needs_root
@pytest.mark.timeout(60)
def test_shaped_link_is_made_and_removed():
    name = f"kvrt{os.getpid() % 100000}"
    with ShapedLink(name, "100mbit") as link:
        assert link.exists()
        sender_addresses = inside(link.sender_namespace, "ip", "-4", "-o", "addr", "show", f"{name}s")
        assert f"{SENDER_ADDRESS}/30" in sender_addresses
        assert f"{RECEIVER_ADDRESS}/30" in inside(link.receiver_namespace, "ip", "-4", "-o", "addr", "show")
        assert "tbf" in inside(link.receiver_namespace, "tc", "qdisc", "show", "dev", f"{name}r")
        assert echo_across(link) == b"across"  # a process that entered the sender side reaches the receiver
    assert not link.exists()
    assert link.sender_namespace not in namespaces()


@needs_root
@pytest.mark.timeout(60)
def test_shaped_link_is_removed_after_an_error_inside():
    link = ShapedLink(f"kvrt{os.getpid() % 100000}", "1gbit")
    with pytest.raises(KeyboardInterrupt):
        with link:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a measurement
    assert not link.exists()


@needs_root
@pytest.mark.timeout(60)
def test_a_failed_setup_leaves_nothing_behind():
    link = ShapedLink(f"kvrt{os.getpid() % 100000}", "0mbit")  # tc refuses a zero rate
    with pytest.raises(RuntimeError, match="tc qdisc add"):
        link.__enter__()
    assert not link.exists()


def interfaces_seen_from(namespace: str, result) -> None:
    """Child process main: what /sys/class/net lists once inside ``namespace``."""
    enter_namespace(namespace)
    result.put(sorted(os.listdir("/sys/class/net")))


@needs_root
@pytest.mark.timeout(60)
def test_a_process_in_a_namespace_sees_its_own_interfaces_in_sysfs():
    """UCX finds network devices in /sys/class/net, which lists the namespace sysfs was
    mounted in: a process that entered a side must see that side's veth and not the other."""
    with ShapedLink(f"kvrs{os.getpid() % 10000}", "1gbit") as link:
        spawn = multiprocessing.get_context("spawn")
        result = spawn.Queue()
        child = spawn.Process(target=interfaces_seen_from, args=(link.sender_namespace, result))
        child.start()
        child.join(30)
        seen = result.get(timeout=5)
        assert link.sender_device in seen and link.receiver_device not in seen, seen
        assert link.sender_device not in os.listdir("/sys/class/net")  # this process's view is unchanged

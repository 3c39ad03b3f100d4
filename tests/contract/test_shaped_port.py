"""The loopback port shaping of the shaped-link tests: only traffic from the shaped port
slows down, nothing is left behind, and a root qdisc someone else made is never replaced.

Needs root and tc with htb; skipped elsewhere.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvroute.bench.shaped_port import ShapedPort, root_qdisc
from kvroute.bench.transfer_netns import ShapingUnavailable
from tests.shaping import UNAVAILABLE

PAYLOAD = 1_000_000
RATE = "20mbit"  # 2.5 MB/s: the payload needs ~0.3 s beyond the 256 KiB burst

pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no port shaping here: {UNAVAILABLE}")


def listener() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))
    server.listen(1)
    return server


def seconds_to_receive(server: socket.socket) -> float:
    """Connect, let the server send PAYLOAD bytes from its port, time the receive."""
    def send():
        connection, _ = server.accept()
        with connection:
            connection.sendall(b"k" * PAYLOAD)

    sender = threading.Thread(target=send)
    sender.start()
    received = 0
    with socket.create_connection(server.getsockname(), timeout=30) as client:
        start = time.perf_counter()
        while chunk := client.recv(1 << 20):
            received += len(chunk)
        elapsed = time.perf_counter() - start
    sender.join(10)
    assert received == PAYLOAD
    return elapsed


def test_only_traffic_from_the_shaped_port_is_slow_and_nothing_is_left():
    with listener() as shaped, listener() as free:
        with ShapedPort(shaped.getsockname()[1], RATE) as port:
            assert root_qdisc() == "htb"
            slow = seconds_to_receive(shaped)
            fast = seconds_to_receive(free)
            assert port.shaped_bytes() >= PAYLOAD
        assert root_qdisc() == "noqueue"
    # 1 MB at 2.5 MB/s, less the burst, cannot take under 0.25 s; loopback takes milliseconds.
    assert slow > 0.25
    assert fast < slow / 5


def test_an_existing_root_qdisc_is_refused_and_kept():
    with ShapedPort(2, RATE):
        with pytest.raises(ShapingUnavailable, match="already has a root qdisc"):
            ShapedPort(3, RATE).__enter__()
        assert root_qdisc() == "htb"  # the first one's still in place
    assert root_qdisc() == "noqueue"


def test_a_bad_rate_changes_nothing():
    with pytest.raises(ValueError):
        ShapedPort(4, "fast").__enter__()
    assert root_qdisc() == "noqueue"

"""The ZeroMQ context of the transfer threads, bound to their CPUs, makes sockets that work."""

from __future__ import annotations

import zmq

from transfer.affinity import transfer_context, transfer_cpus


def test_transfer_context_makes_working_sockets():
    context = transfer_context(transfer_cpus(""))
    try:
        server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"ping")
        assert server.poll(5000) and server.recv() == b"ping"
    finally:
        context.destroy(linger=0)

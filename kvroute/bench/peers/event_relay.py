"""A loopback relay for vLLM's KV events, so that no process of the benchmark binds beyond 127.0.0.1.

vLLM's ZeroMQ publisher binds only wildcard endpoints (``tcp://*:PORT``: every interface) and
*connects* to any other address, and vllm-router's ``kv_aware`` policy connects to the
publisher. So each engine's publisher connects to this relay's XSUB on 127.0.0.1, and the
router connects to its XPUB on 127.0.0.1: the messages pass unchanged, subscriptions flow
back up.

Usage::

    python -m kvroute.bench.peers.event_relay --inbound tcp://127.0.0.1:A --outbound tcp://127.0.0.1:B

Runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal


def relay(inbound: str, outbound: str) -> None:
    import zmq

    context = zmq.Context()
    publishers = context.socket(zmq.XSUB)
    publishers.bind(inbound)
    subscribers = context.socket(zmq.XPUB)
    subscribers.bind(outbound)
    try:
        zmq.proxy(publishers, subscribers)
    except (zmq.ContextTerminated, KeyboardInterrupt):
        pass
    finally:
        context.destroy(linger=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inbound", required=True, help="where publishers connect (XSUB binds here)")
    parser.add_argument("--outbound", required=True, help="where subscribers connect (XPUB binds here)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the proxy as Ctrl-C does
    relay(args.inbound, args.outbound)


if __name__ == "__main__":
    main()

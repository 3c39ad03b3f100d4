"""What a peer of a transfer endpoint can cost it: an ``OpenLink`` for a backend the endpoint
does not host is refused at first contact, before anything binds or waits, while pulls
go on being served; pulls naming handles that never come wait in a bounded list and the
rest are refused at once."""

from __future__ import annotations

import secrets
import time

import pytest
import torch
import zmq

from foundation import wire
from foundation.endpoint_client import PullFailed
from foundation.zmq_auth import secure_client
from tests.contract.transfer_endpoint import PARK_SECONDS, Producer, assert_pulled, pull_into
from tests.paged_caches import CONSUMER_BLOCKS, make_cache
from transfer.link_control import open_consumer_link
from transfer.settings import ConnectorSettings
from transfer.transports.settings import TransportSettings

pytestmark = pytest.mark.timeout(60)

FAST = 1.0  # seconds: a refusal or a pull beside refused links takes far less (a stalled one took 10 s)


def endpoint_settings(transfer_link: str) -> TransportSettings:
    """The link settings a worker started with ``--transfer-link transfer_link`` gives its endpoint."""
    return ConnectorSettings(transfer_address="tcp://127.0.0.1:1", transfer_link=transfer_link).link_settings()


@pytest.fixture
def consumer():
    return make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)


def raw_open_link(context, address: str, layout: wire.KVLayoutSpec, backend: str) -> zmq.Socket:
    """A consumer's first contact asking for ``backend``, sent without waiting for the answer."""
    socket = secure_client(context.socket(zmq.DEALER), "worker", transfer=True)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    hello = wire.LinkHello(role="receiver", layout=layout, device="cpu", host_id="elsewhere", backends=[backend],
                           requested=backend)
    socket.send(wire.encode(wire.OpenLink(link_id=secrets.token_hex(16), payload=wire.encode(hello))))
    return socket


@pytest.mark.parametrize("transfer_link, asked", [("endpoint", "gloo"), ("endpoint", "fake"), ("zmq-tcp", "gloo"),
                                                  ("auto", "gloo"), ("auto", "fake")])
def test_a_link_for_a_backend_the_endpoint_does_not_host_is_refused_at_once(context, consumer, transfer_link, asked):
    with Producer(torch.bfloat16, "block-dim-1", endpoint_settings(transfer_link)).serving() as producer:
        started = time.monotonic()
        with pytest.raises(PullFailed, match=f"could not open a {asked} link"):
            open_consumer_link(context, producer.address, consumer.spec, torch.device("cpu"),
                               TransportSettings(backend=asked))
        assert time.monotonic() - started < FAST
        assert producer.counters.snapshot().links_opened == 0


def test_pulls_are_served_while_a_peer_asks_for_links_the_endpoint_does_not_host(context, consumer):
    with Producer(torch.bfloat16, "block-dim-1", endpoint_settings("endpoint")).serving() as producer:
        askers = [raw_open_link(context, producer.address, consumer.spec, "gloo") for _ in range(5)]
        _, source = producer.lease((3, 8))
        started = time.monotonic()
        pull_into(context, consumer, source, [0, 1], [0, 1])
        assert time.monotonic() - started < FAST
        assert_pulled(producer, consumer, [3, 8], [0, 1])
        for asker in askers:  # each got the endpoint's hello and no setup: nothing was hosted
            assert asker.poll(int(FAST * 1000))
            assert isinstance(wire.decode(asker.recv()), wire.LinkHello)
            asker.close(linger=0)


def test_the_endpoints_own_backend_still_opens_a_link(context, consumer):
    with Producer(torch.bfloat16, "block-dim-1", endpoint_settings("zmq-tcp")).serving() as producer:
        link = open_consumer_link(context, producer.address, consumer.spec, torch.device("cpu"),
                                  TransportSettings(backend="zmq-tcp"))
        assert link.receiver.backend == "zmq-tcp"
        link.close()


def test_pulls_for_unknown_handles_wait_in_a_bounded_list(context, consumer):
    max_parked, sent = 4, 40
    with Producer(torch.bfloat16, "block-dim-1", max_parked=max_parked).serving() as producer:
        socket = secure_client(context.socket(zmq.DEALER), "worker", transfer=True)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(producer.address)
        for _ in range(sent):
            socket.send(wire.encode(wire.PullBlocks(handle=secrets.token_hex(16), block_indices=[0],
                                                    layout=consumer.spec)))
        refused_at_once = []
        while socket.poll(int(PARK_SECONDS * 500)):  # answers well before the parked ones give up
            refused_at_once.append(wire.decode(socket.recv()))
        assert len(refused_at_once) == sent - max_parked
        assert all(not header.ok and "already wait" in header.error for header in refused_at_once)

        _, source = producer.lease((5,))  # a real pull is served beside the parked ones
        started = time.monotonic()
        pull_into(context, consumer, source, [0], [2])
        assert time.monotonic() - started < FAST

        late = []
        while len(late) < max_parked and socket.poll(int((PARK_SECONDS + FAST) * 1000)):
            late.append(wire.decode(socket.recv()))
        assert [header.error for header in late] == ["unknown or expired handle"] * max_parked
        socket.close(linger=0)

"""``auto`` links choose between zmq-ipc and nixl by measurement at link set-up
(``transfer.transports.probing``), against a real BlockServer: whichever candidate is slowed
on purpose loses, both ends keep the same backend and expose the measurement, a candidate
that cannot be set up is never chosen, nothing is measured where an end does not offer nixl,
and what other consumers send to the endpoint while it probes is answered afterwards. A
consumer connector whose link chose nixl READs staged leases directly; one whose link chose
zmq-ipc takes the link's frames."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from foundation.endpoint_client import fetch_transfer_stats
from tests.contract.transfer_endpoint import (
    DEADLINE_SECONDS,
    Producer,
    assert_pulled,
    consumer_connector,
    run_loads,
    stage_arena_lease,
)
from tests.paged_caches import CONSUMER_BLOCKS, make_cache
from transfer.kv_layout import block_index_tensor
from transfer.link_control import open_consumer_link, pull_over_link
from transfer.metadata import LoadSpec
from transfer.transports import nixl_backend, zmq_backend
from transfer.transports.nixl_agent import nixl_missing
from transfer.transports.settings import TransportSettings

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(bool(nixl_missing()), reason="nixl_cu12 is not installed: auto measures nothing")]

SLOWER_SECONDS = 0.1  # per probe transfer: several times either backend's own time for a probe, on a loaded machine too
RECEIVERS = {"zmq-ipc": zmq_backend.ZmqReceiver, "nixl": nixl_backend.NixlReceiver}


def slow_down(monkeypatch, backend: str) -> None:
    """Every transfer the ``backend`` receiver takes in waits SLOWER_SECONDS more."""
    receiver = RECEIVERS[backend]
    receive_frames = receiver._receive_frames

    def slower(self, *args, **kwargs):
        time.sleep(SLOWER_SECONDS)
        return receive_frames(self, *args, **kwargs)

    monkeypatch.setattr(receiver, "_receive_frames", slower)


@pytest.fixture
def producer():
    with Producer(torch.bfloat16, "block-dim-1", TransportSettings()).serving() as producer:
        yield producer


@pytest.fixture
def consumer():
    return make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)


def open_auto_link(context, producer, consumer):
    return open_consumer_link(context, producer.address, consumer.spec, torch.device("cpu"), TransportSettings())


@pytest.mark.parametrize("slowed, winner", [("nixl", "zmq-ipc"), ("zmq-ipc", "nixl")])
def test_the_candidate_measured_slower_loses_and_both_ends_keep_the_winner(context, producer, consumer,
                                                                          monkeypatch, slowed, winner):
    slow_down(monkeypatch, slowed)
    link = open_auto_link(context, producer, consumer)
    try:
        assert link.receiver.backend == winner
        measurement = link.receiver.measurement
        assert measurement.chosen == winner and measurement.candidates == ["zmq-ipc", "nixl"]
        slowed_seconds, winner_seconds = (measurement.seconds[measurement.candidates.index(name)]
                                          for name in (slowed, winner))
        assert slowed_seconds > SLOWER_SECONDS > winner_seconds
        producer_side = fetch_transfer_stats(context, producer.address).counters
        assert producer_side.links_measured == 1
        assert producer_side.link_measurements == [measurement]  # the producer kept what the consumer chose

        _, source = producer.lease((3, 7, 1))  # the chosen link carries pulls bit-exactly
        local = block_index_tensor([0, 4, 9])
        nbytes = pull_over_link(context, source, [0, 2], consumer.spec, link,
                                lambda layer, data: consumer.scatter_layer(layer, local[:2], data),
                                time.monotonic() + DEADLINE_SECONDS)
        assert nbytes == 2 * consumer.spec.bytes_per_block
        assert_pulled(producer, consumer, [3, 1], [0, 4])
    finally:
        link.close()


def test_a_candidate_that_cannot_be_hosted_is_never_chosen(context, producer, consumer, monkeypatch):
    def refuse(self, options, deadline):
        raise RuntimeError("UCX could not start")

    monkeypatch.setattr(nixl_backend.NixlBackend, "host", refuse)
    slow_down(monkeypatch, "zmq-ipc")  # even when the only candidate left is slow
    link = open_auto_link(context, producer, consumer)
    try:
        assert link.receiver.backend == "zmq-ipc"
        assert link.receiver.measurement.seconds[1] is None
    finally:
        link.close()


def test_nothing_is_measured_where_the_producer_does_not_offer_nixl(context, consumer):
    without_nixl = TransportSettings(hosted=("zmq-ipc", "zmq-tcp"))
    with Producer(torch.bfloat16, "block-dim-1", without_nixl).serving() as producer:
        link = open_auto_link(context, producer, consumer)
        try:
            assert link.receiver.backend == "zmq-ipc" and link.receiver.measurement is None
            assert fetch_transfer_stats(context, producer.address).counters.links_measured == 0
        finally:
            link.close()


def test_what_others_send_while_the_endpoint_probes_is_answered_afterwards(context, producer, consumer,
                                                                           monkeypatch):
    slow_down(monkeypatch, "nixl")  # the probes take a while
    answers: list = []

    def ask_for_stats() -> None:
        time.sleep(SLOWER_SECONDS)  # while the probe of the first candidate runs
        other = zmq.Context()
        try:
            answers.append(fetch_transfer_stats(other, producer.address, timeout=DEADLINE_SECONDS))
        finally:
            other.destroy(linger=0)

    asker = threading.Thread(target=ask_for_stats)
    asker.start()
    link = open_auto_link(context, producer, consumer)
    asker.join(DEADLINE_SECONDS + 1)
    try:
        assert link.receiver.backend == "zmq-ipc"
        assert len(answers) == 1 and answers[0].layout == producer.cache.spec
    finally:
        link.close()


@pytest.mark.parametrize("slowed, direct", [("zmq-ipc", True), ("nixl", False)], ids=["nixl-chosen", "zmq-chosen"])
def test_an_auto_consumer_reads_directly_only_from_a_producer_its_link_chose_nixl_for(monkeypatch, slowed, direct):
    slow_down(monkeypatch, slowed)
    worker, cache = consumer_connector("auto")
    try:
        with Producer(torch.bfloat16, "block-dim-0", TransportSettings()).serving() as producer:
            _, staged = stage_arena_lease(producer, (3, 7, 1))  # as an auto producer stages it
            finished, failed = run_loads(worker, [LoadSpec("staged", staged, (0, 1, 2), (8, 0, 5))])
            assert finished == {"staged"} and not failed
            assert_pulled(producer, cache, (3, 7, 1), (8, 0, 5))
            counters = worker.counters.snapshot()
            assert counters.links_measured == 1 and counters.pulls_ok == 1
            assert counters.direct_pulls == int(direct)
            assert (counters.bytes_scattered == 0) == direct  # a link's frames are scattered; a READ is not
    finally:
        worker.shutdown()

"""The pure parts of nixl links (``transfer.transports.nixl_backend``, ``nixl_agent``, ``nixl_buffers``):
addresses, notices and their sorting by link, buffer sizes, registered send buffers
against a fake agent, and how NIXL's exceptions become transport errors. None of these
needs nixl_cu12; the contract suite runs the links themselves."""

from __future__ import annotations

import time

import pytest
import torch

from transfer.transports import nixl_buffers
from transfer.transports.errors import LinkRefused, PeerLost, TransportError, TransportTimeout
from transfer.transports.nixl_agent import (
    UCX_TCP_DEFAULTS,
    Closed,
    Frames,
    Header,
    Joined,
    Mailboxes,
    Released,
    decode_notice,
    encode_notice,
    ucx_environment,
    wait_until,
)
from transfer.transports.nixl_backend import format_address, parse_address, translate
from transfer.transports.nixl_buffers import ReadBuffer, RegisteredBuffers, buffer_bytes

METADATA = bytes(range(256)) * 2  # every byte value, as NIXL's binary metadata may hold


def test_an_address_carries_the_link_and_the_metadata_intact():
    address = format_address("ab12", METADATA)
    assert address.startswith("nixl://ab12/") and address.isascii()
    assert parse_address(address) == ("ab12", METADATA)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "nixl://", "nixl://link-only", "nixl:///bWV0YQ==",
                                     "nixl://ab/not*base64"])
def test_anything_else_is_refused_as_an_address(address):
    with pytest.raises(LinkRefused, match="not a nixl link address"):
        parse_address(address)


@pytest.mark.parametrize("notice", [
    Joined("l1", METADATA),
    Header("l1", b"\x00" * 48),
    Frames("l1", 3, 0x7F00_0000_1000, 1 << 20, 0),
    Frames("l1", 4, 0x1000, 24, 1, digests=b"d" * 24, metadata=[METADATA, b"more"]),
    Released("l1", 9),
    Closed("l1", "the sender closed the link"),
])
def test_notices_round_trip(notice):
    assert decode_notice(encode_notice(notice)) == notice


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", encode_notice(Released("l1", 1))[:-1], b"\x92\xa3who\xa2l1"])
def test_anything_else_decodes_to_none(payload):
    assert decode_notice(payload) is None


def test_mailboxes_file_notices_under_their_links_in_order_and_drop_the_rest():
    mailboxes = Mailboxes()
    mailboxes.open("a")
    mailboxes.open("b")
    mailboxes.sort({"peer-1": [encode_notice(Released("a", 0)), encode_notice(Header("b", b"h")), b"junk",
                               encode_notice(Released("gone", 0)), encode_notice(Released("a", 1))],
                    "peer-2": [encode_notice(Closed("b", "bye"))]})
    assert mailboxes.take("a") == ("peer-1", Released("a", 0))
    assert mailboxes.take("a") == ("peer-1", Released("a", 1))
    assert mailboxes.take("b") == ("peer-1", Header("b", b"h"))
    assert mailboxes.take("b") == ("peer-2", Closed("b", "bye"))
    mailboxes.close("a")
    mailboxes.sort({"peer-1": [encode_notice(Released("a", 2))]})
    assert mailboxes.take("a") is None and mailboxes.take("b") is None and mailboxes.take("gone") is None


def test_wait_until_returns_the_first_value_and_times_out_by_the_deadline():
    answers = iter([None, None, "ready"])
    assert wait_until(lambda: next(answers), time.monotonic() + 1, "an answer") == "ready"
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="waiting for nothing"):
        wait_until(lambda: None, started + 0.05, "nothing")
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("nbytes, expected", [(0, 64 << 10), (1, 64 << 10), (64 << 10, 64 << 10),
                                              ((64 << 10) + 1, 128 << 10), (3 << 20, 4 << 20), (4 << 20, 4 << 20)])
def test_buffers_are_powers_of_two_of_at_least_64_kib(nbytes, expected):
    assert buffer_bytes(nbytes) == expected


def _nixl_error(name: str) -> Exception:
    kind = type(name, (Exception,), {"__module__": "nixl_cu12._bindings"})
    return kind("NIXL_ERR")


def test_nixl_exceptions_become_transport_errors_and_others_stay_as_they_are():
    assert isinstance(translate(_nixl_error("nixlRemoteDisconnectError")), PeerLost)
    backend_error = translate(_nixl_error("nixlBackendError"))
    assert type(backend_error) is TransportError and "nixlBackendError" in str(backend_error)
    assert translate(ValueError("ours")) is None


class FakeAgent:
    """Counts registrations the way a NIXL agent holds them."""

    def __init__(self):
        self.registered: dict[int, int] = {}  # registration token -> buffer bytes

    def register(self, tensor: torch.Tensor):
        token = len(self.registered) + 1000 * tensor.numel()
        self.registered[token] = tensor.numel()
        return token, f"metadata-{tensor.numel()}".encode()

    def deregister(self, registration) -> None:
        del self.registered[registration]


class Pending:
    done = False

    def wait(self, timeout: float) -> None:
        raise AssertionError("a full pool should not wait in this test")


def test_registered_buffers_register_once_grow_and_leave_nothing_behind(monkeypatch):
    held = []
    monkeypatch.setattr(nixl_buffers, "quarantine", lambda *items: held.extend(items))
    agent = FakeAgent()
    pool = RegisteredBuffers(agent, torch.device("cpu"))

    slot, buffer = pool.acquire(100_000)
    assert pool.take_new_metadata() == [b"metadata-131072"] and pool.take_new_metadata() == []
    pool.mark_sent(slot, None)
    again_slot, again = pool.acquire(90_000)  # reused as it is: no new registration, no metadata
    assert again.data_ptr() == buffer.data_ptr() and pool.take_new_metadata() == []
    pool.mark_sent(again_slot, None)
    assert sorted(agent.registered.values()) == [131072]

    in_flight_slot, in_flight = pool.acquire(3 << 20)  # larger: a new buffer, registered once
    pool.mark_sent(in_flight_slot, Pending())
    assert pool.take_new_metadata() == [b"metadata-4194304"]
    assert sorted(agent.registered.values()) == [131072, 4 << 20]

    pool.close()
    assert agent.registered == {}
    assert [item.data_ptr() for item in held] == [in_flight.data_ptr()]  # a peer may still read it


def test_a_full_pool_deregisters_the_buffer_a_larger_one_replaces():
    agent = FakeAgent()
    pool = RegisteredBuffers(agent, torch.device("cpu"), max_buffers=1)
    slot, _ = pool.acquire(10)
    pool.mark_sent(slot, None)
    slot, _ = pool.acquire(1 << 20)
    pool.mark_sent(slot, None)
    assert sorted(agent.registered.values()) == [1 << 20]


@pytest.mark.parametrize("host, environment, added", [
    ("127.0.0.1", {}, {"UCX_NET_DEVICES": "lo"}),
    ("::1", {}, {"UCX_NET_DEVICES": "lo"}),
    ("localhost", {}, {"UCX_NET_DEVICES": "lo"}),
    ("127.0.0.1", {"UCX_NET_DEVICES": "eth0"}, {}),  # the operator's choice stands
    ("10.0.0.7", {}, {}),  # links between hosts: UCX picks the devices
    ("worker-3.example", {}, {}),
])
def test_ucx_listens_on_loopback_only_for_loopback_links(host, environment, added):
    devices = {name: value for name, value in ucx_environment(host, environment).items()
               if name not in UCX_TCP_DEFAULTS}
    assert devices == added


def test_ucx_gets_tcp_segments_for_reads_unless_the_operator_set_them():
    assert ucx_environment("10.0.0.7", {}) == UCX_TCP_DEFAULTS
    assert UCX_TCP_DEFAULTS["UCX_TCP_TX_SEG_SIZE"] == "1m"
    chosen = ucx_environment("10.0.0.7", {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_SNDBUF": "1m"})
    assert chosen == {"UCX_TCP_RX_SEG_SIZE": "1m", "UCX_TCP_RCVBUF": "4m"}


def test_a_read_buffer_grows_by_registering_anew_and_closes_clean():
    agent = FakeAgent()
    buffer = ReadBuffer(agent, torch.device("cpu"))
    assert buffer.take(0).numel() == 0 and sorted(agent.registered.values()) == [64 << 10]
    first = buffer.take(50_000)
    assert buffer.take(60_000).data_ptr() == first.data_ptr()  # fits: the same registration
    assert buffer.take(1 << 20).numel() == 1 << 20
    assert sorted(agent.registered.values()) == [1 << 20]
    buffer.close()
    assert agent.registered == {}

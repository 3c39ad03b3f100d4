"""What peers hand us about themselves: addresses checked before a socket connects, ids of
bounded length, warnings about a peer at most once per interval, and bounded memory of
peer-chosen keys."""

from __future__ import annotations

import logging

import pytest

from foundation.addresses import AddressError, check_host, check_peer_address
from foundation.heartbeat_checks import check_name
from foundation.log_limits import PeerWarnings
from foundation.lru import LruDict


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:7001", "tcp://localhost:1", "tcp://worker-3.pool.svc:65535",
                                     "tcp://[::1]:7001", "tcp://[fe80::1]:20000", "ipc:///tmp/kvroute/a.sock"])
def test_addresses_workers_advertise_pass(address):
    check_peer_address(address)


@pytest.mark.parametrize("address, says", [
    ("", "empty"), ("garbage", "not tcp"), ("udp://h:1", "not tcp"), ("tcp://h", "port"), ("tcp://h:0", "port"),
    ("tcp://h:65536", "port"), ("tcp://h:-1", "port"), ("tcp://h:1e3", "port"), ("tcp://:1", "host"),
    ("tcp://*:1", "host"), ("tcp://0.0.0.0:1", "wildcard"), ("tcp://[::]:1", "wildcard"), ("tcp://[zz]:1", "IP"),
    ("tcp://999.1.1.1:1", "IP"), ("tcp://a;b:1", "host"), ("tcp://a b:1", "host"), ("tcp://h\n:1", "printable"),
    ("tcp://hôte:1", "printable"), ("ipc://relative", "ipc path"), ("ipc:///", "ipc path"),
    ("tcp://" + "a" * 300 + ":1", "longer than"),
])
def test_malformed_addresses_are_refused_saying_why(address, says):
    with pytest.raises(AddressError, match=says):
        check_peer_address(address, "rpc_address")


def test_a_wildcard_host_is_not_a_host_to_advertise():
    with pytest.raises(AddressError):
        check_host("0.0.0.0")


@pytest.mark.parametrize("name", ["", "x" * 129, "a b", "tab\t", "é"])
def test_names_are_short_printable_ascii(name):
    with pytest.raises(ValueError):
        check_name(name, "worker_id")


def test_lru_dict_keeps_the_most_recently_written_keys():
    memo = LruDict(3)
    for key in "abcd":
        memo[key] = key.upper()
    memo["b"] = "B2"  # written again: now the newest
    memo["e"] = "E"
    assert list(memo) == ["d", "b", "e"]


def test_peer_warnings_log_once_per_interval_and_tell_how_many_were_held_back(caplog):
    clock = [0.0]
    warnings = PeerWarnings(logging.getLogger("test.peers"), interval_seconds=10, max_peers=2, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="test.peers"):
        assert warnings.warn("10.0.0.9", "bad frame %d", 1)
        assert not any(warnings.warn("10.0.0.9", "bad frame %d", n) for n in range(2, 100))
        assert warnings.warn("10.0.0.8", "bad frame %d", 1)  # another peer has its own interval
        clock[0] = 10.0
        assert warnings.warn("10.0.0.9", "bad frame %d", 100)
    assert [record.getMessage() for record in caplog.records] == [
        "from 10.0.0.9: bad frame 1", "from 10.0.0.8: bad frame 1",
        "from 10.0.0.9: bad frame 100 (98 more from this peer in the last 10 s)"]

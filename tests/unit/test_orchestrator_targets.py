"""Where heartbeats go (worker.orchestrator_targets): fixed addresses, and DNS names
looked up again on a schedule, keeping the last good answer through failed lookups."""

from __future__ import annotations

import pytest

from foundation.addresses import AddressError
from worker.orchestrator_targets import DnsName, OrchestratorTargets, parse_entry


@pytest.mark.parametrize("entry, parsed", [
    ("tcp://10.0.0.1:7001", "tcp://10.0.0.1:7001"),
    ("dns://kvroute-registry:7001", DnsName("kvroute-registry", 7001)),
    ("dns://kvroute-registry.kvroute.svc.cluster.local:7001",
     DnsName("kvroute-registry.kvroute.svc.cluster.local", 7001)),
])
def test_entries_parse(entry, parsed):
    assert parse_entry(entry) == parsed


@pytest.mark.parametrize("entry, message", [
    ("dns://kvroute-registry", "dns://NAME:PORT"),
    ("dns://kvroute-registry:0", "dns://NAME:PORT"),
    ("dns://kvroute-registry:http", "dns://NAME:PORT"),
    ("dns://bad_name!:7001", "no valid host"),
    ("http://10.0.0.1:7001", "tcp://HOST:PORT"),
    ("tcp://0.0.0.0:7001", "wildcard"),
])
def test_bad_entries_say_what_is_wrong(entry, message):
    with pytest.raises(AddressError, match=message):
        parse_entry(entry)


class FakeResolver:
    """Answers with ``records[name]``; a missing name fails as an unknown one does."""

    def __init__(self, records: dict[str, list[str]]):
        self.records = records
        self.lookups = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        self.lookups += 1
        if name not in self.records:
            raise OSError(-2, "Name or service not known")
        return self.records[name]


async def test_a_name_stands_for_every_address_it_has_beside_fixed_ones():
    resolver = FakeResolver({"registry": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::5"]})
    targets = OrchestratorTargets(("tcp://10.9.9.9:7001", "dns://registry:7001", "tcp://10.0.0.1:7001"),
                                  resolve_seconds=5, lookup=resolver)
    assert await targets.current(0.0) == ("tcp://10.9.9.9:7001", "tcp://10.0.0.1:7001", "tcp://10.0.0.2:7001",
                                          "tcp://[fd00::5]:7001")


async def test_a_name_is_looked_up_again_only_once_the_interval_passed():
    resolver = FakeResolver({"registry": ["10.0.0.1"]})
    targets = OrchestratorTargets(("dns://registry:7001",), resolve_seconds=5, lookup=resolver)
    assert await targets.current(0.0) == ("tcp://10.0.0.1:7001",)
    resolver.records["registry"] = ["10.0.0.1", "10.0.0.3"]  # a replica appears
    assert await targets.current(4.9) == ("tcp://10.0.0.1:7001",) and resolver.lookups == 1
    assert await targets.current(5.0) == ("tcp://10.0.0.1:7001", "tcp://10.0.0.3:7001")
    resolver.records["registry"] = ["10.0.0.3"]  # and the first one goes
    assert await targets.current(10.0) == ("tcp://10.0.0.3:7001",)


async def test_a_failed_lookup_keeps_the_last_answer_and_is_tried_again_at_the_next_call():
    resolver = FakeResolver({})
    targets = OrchestratorTargets(("dns://registry:7001",), resolve_seconds=5, lookup=resolver)
    assert await targets.current(0.0) == ()  # no orchestrator has a record yet
    resolver.records["registry"] = ["10.0.0.1"]
    assert await targets.current(1.0) == ("tcp://10.0.0.1:7001",)  # found at the next beat, not 5 s later
    del resolver.records["registry"]
    assert await targets.current(6.0) == ("tcp://10.0.0.1:7001",)
    assert await targets.current(7.0) == ("tcp://10.0.0.1:7001",) and resolver.lookups == 4

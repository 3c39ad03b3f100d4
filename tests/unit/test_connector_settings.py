"""Which pulls of a consumer's connector go over a transport link, and which link: its settings
from vLLM's extra config (the pulls themselves are in tests/contract/test_transfer_links.py)."""

from __future__ import annotations

import pytest

from transfer.settings import ConnectorSettings
from transfer.transports.settings import TransportSettings


def test_the_connector_setting_names_a_link_or_the_endpoint():
    base = {"transfer_address": "tcp://10.0.0.7:7000"}
    assert not ConnectorSettings.from_extra_config(base).uses_links
    settings = ConnectorSettings.from_extra_config({**base, "transfer_link": "gloo"})
    assert settings.uses_links and settings.link_settings() == TransportSettings(backend="gloo", host="10.0.0.7")
    assert ConnectorSettings.from_extra_config(base).link_settings().backend == "auto"
    with pytest.raises(ValueError, match="transfer_link must be one of"):
        ConnectorSettings.from_extra_config({**base, "transfer_link": "carrier-pigeon"})


@pytest.mark.parametrize("extra, hosted", [
    ({}, ("zmq-ipc", "zmq-tcp")),  # the endpoint: only the links that cost it no wait
    ({"transfer_link": "auto"}, None),  # what auto picks (selection.hosted_backends)
    ({"transfer_link": "gloo"}, None),  # gloo and the ZeroMQ ones
    ({"transfer_link_hosts": "zmq-tcp,gloo"}, ("zmq-tcp", "gloo")),
])
def test_the_endpoint_hosts_the_links_it_was_configured_for(extra, hosted):
    settings = ConnectorSettings.from_extra_config({"transfer_address": "tcp://10.0.0.7:7000", **extra})
    assert settings.link_settings().hosted == hosted


@pytest.mark.parametrize("extra, says", [({"transfer_link_hosts": "gloo,smoke-signals"}, "transfer_link_hosts"),
                                         ({"max_parked_pulls": 0}, "max_parked_pulls")])
def test_bad_endpoint_limits_stop_the_start(extra, says):
    with pytest.raises(ValueError, match=says):
        ConnectorSettings.from_extra_config({"transfer_address": "tcp://10.0.0.7:7000", **extra})

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

"""The rate arithmetic of the shaped link of ``kvroute bench transfer``: rates in tc's spelling,
and tbf's burst."""

from __future__ import annotations

import pytest

from kvroute.bench.transfer_netns import burst_bytes, rate_bits_per_second


@pytest.mark.parametrize("rate, bits", [("100mbit", 10**8), ("1gbit", 10**9), ("1.5gbit", 15 * 10**8),
                                        ("500kbit", 5 * 10**5)])
def test_rates_in_tc_spelling(rate, bits):
    assert rate_bits_per_second(rate) == bits


def test_bad_rates_and_the_burst_floor():
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        rate_bits_per_second("fast")
    assert burst_bytes("100mbit") == 256 * 1024  # 50 KB per tick, raised to the floor
    assert burst_bytes("10gbit") == 10**10 // 8 // 250

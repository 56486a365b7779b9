"""Network prefixes of client addresses: every spelling of one address lands on one network."""

import pytest

from crowdtrain.core.addresses import canonical_address, network_prefix


@pytest.mark.parametrize(
    ("address", "network"),
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("203.0.113.250", "203.0.113.0/24"),
        ("::ffff:203.0.113.7", "203.0.113.0/24"),
        ("[2001:db8:1:2::5]", "2001:db8:1::/48"),
        ("127.0.0.1", "127.0.0.1/32"),
        ("127.0.1.1", "127.0.1.1/32"),
        ("::1", "::1/128"),
        ("testclient", ""),
        ("", ""),
    ],
)
def test_each_address_has_one_network(address: str, network: str) -> None:
    assert network_prefix(address) == network


def test_an_ipv4_mapped_address_is_its_ipv4() -> None:
    assert canonical_address("::ffff:198.51.100.9") == "198.51.100.9"
    assert canonical_address("not-an-address") == ""

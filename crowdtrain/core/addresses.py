"""Client network addresses: the network a host registers from, for limits and replica spread.

No I/O. Two hosts on one network prefix (an IPv4 /24, an IPv6 /48) are taken to be under one party's
control: a vote between them is no vote, and registrations from one prefix share one limit.
"""

import ipaddress

IPV4_PREFIX = 24
IPV6_PREFIX = 48


def canonical_address(address: str) -> str:
    """The address in one spelling (an IPv4-mapped IPv6 address as its IPv4); "" if it is not an IP address
    (a test client's name, a Unix socket)."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def network_prefix(address: str) -> str:
    """The network `address` belongs to, as CIDR text ("203.0.113.0/24"); "" for an address that is not an IP
    address. Loopback addresses keep their full address: hosts on one machine in a test or a trial are told
    apart only by the address they bind."""
    canonical = canonical_address(address)
    if not canonical:
        return ""
    ip = ipaddress.ip_address(canonical)
    if ip.is_loopback:
        return f"{ip}/{ip.max_prefixlen}"
    bits = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))

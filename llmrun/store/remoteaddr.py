"""Where a remote model (FROM http(s)://) may not make the daemon connect: link-local
addresses (169.254.0.0/16, fe80::/10) and the cloud metadata services, which hand out the
machine's cloud credentials to any process that asks (AWS, GCP, Azure, OpenStack and most
others answer on 169.254.169.254). `LLMRUN_REMOTE_LINK_LOCAL=1` lets the owner allow them.

The same rule is applied twice: to a URL's host as written, when a model is created (a clear
error at once), and to every address a host name resolves to, just before connecting
(server/upstream.py), since a name can resolve anywhere and a literal can be spelled in many
ways (`2852039166`, `0xa9fea9fe`, `169.254.43518`, `[::ffff:169.254.169.254]`, which the C
library's resolver all reads as 169.254.169.254).
"""

from __future__ import annotations

import ipaddress
import re
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Metadata services outside the link-local ranges, and the names they answer under.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean... (link-local too)
    "169.254.170.2",  # AWS ECS task credentials (link-local too)
    "fd00:ec2::254",  # AWS's IMDS over IPv6 (a unique-local address, not link-local)
    "fd20:ce::254",  # GCP's metadata server over IPv6
    "100.100.100.200",  # Alibaba Cloud
))
METADATA_NAMES = frozenset((
    "metadata.google.internal", "metadata.goog", "metadata", "instance-data",
    "instance-data.ec2.internal", "metadata.tencentyun.com",
))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_INET_ATON = re.compile(r"[0-9a-fA-FxX.]+")  # the characters of inet_aton's forms

LINK_LOCAL_HINT = "LLMRUN_REMOTE_LINK_LOCAL=1 allows it"


def _embedded(ip: IPAddress) -> list[IPAddress]:
    """`ip` and the IPv4 address an IPv6 one carries (mapped, compatible, NAT64, 6to4), which
    is where a packet to it may end up."""
    out: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            out.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            out.append(ip.sixtofour)
        if ip in NAT64 or (ip in IPV4_COMPATIBLE and int(ip) > 1):
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def address_refusal(ip: IPAddress) -> str | None:
    """Why a remote model may not connect to `ip` (None: it may); the owner's setting aside."""
    for each in _embedded(ip):
        if each in METADATA_ADDRESSES:
            return f"{ip} is a cloud metadata service"
        if each.is_link_local:
            return f"{ip} is a link-local address"
    return None


def literal_address(host: str) -> IPAddress | None:
    """The IP address `host` spells, in any form the resolver reads as one (dotted quad,
    IPv6 with or without brackets and zone, and inet_aton's decimal, hex, octal and short
    forms); None for a name."""
    text = host.strip().strip("[]").rstrip(".")
    try:
        return ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        pass
    if _INET_ATON.fullmatch(text) and any(c.isdigit() for c in text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def host_refusal(host: str) -> str | None:
    """Why a remote model may not name `host` (a URL's host as written), None when only its
    resolved addresses can tell (checked again at connect time)."""
    if host.strip().rstrip(".").lower() in METADATA_NAMES:
        return f"{host} is a cloud metadata service"
    ip = literal_address(host)
    return address_refusal(ip) if ip is not None else None

"""The client's IP: the socket peer, unless that peer is a trusted proxy, then walked back through X-Forwarded-For."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def client_ip(peer: str, forwarded_for: Sequence[str], trusted: Sequence[Network]) -> str:
    """Rightmost address not in `trusted`: the first hop a trusted proxy could not have been told by the client.

    `forwarded_for` is every X-Forwarded-For header line in order: proxies may append a line instead of extending
    the last one, and reading only the first line would hand the choice back to the client.
    """
    if not trusted:  # no proxy is believed (the default): the peer is the client, as the socket reported it
        return peer
    hops = [peer]
    if forwarded_for:
        hops = [peer, *reversed([h.strip() for line in forwarded_for for h in line.split(",") if h.strip()])]
    for hop in hops:
        try:
            address = ipaddress.ip_address(hop)
        except ValueError:
            return hop  # not an address (garbage or obfuscated): stop trusting here
        if not any(address in net for net in trusted):
            return str(address)
    return hops[-1]

"""Parse and normalise prefill targets and allowlist entries (pure functions, no I/O).

A prefill target arrives in a client-controlled header, so it is hostile input. Everything that
names an address is reduced to one canonical ``ipaddress`` object before it is compared:
IPv4 in any form the C resolver accepts (``2130706433``, ``0x7f000001``, ``0177.0.0.1``,
``127.1``), IPv6 with or without brackets, and IPv4-mapped IPv6 (``::ffff:127.0.0.1``), which
reaches the IPv4 host, becomes that IPv4 address. A name is only syntax-checked here; the caller
resolves it and checks every address it resolves to. Anything that does not parse cleanly
(user info, paths, zone ids, stray characters) is refused rather than guessed at.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$", re.IGNORECASE)


class TargetError(ValueError):
    """A prefill target or allowlist entry that is not a clean host[:port]."""


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed prefill target: ``ip`` is set when ``host`` is an address literal (canonical form)."""

    host: str
    port: int
    ip: IPAddress | None
    scheme: str | None = None

    @property
    def host_port(self) -> str:
        """``host:port`` as it goes into a Host header (IPv6 bracketed)."""
        shown = f"[{self.ip}]" if isinstance(self.ip, ipaddress.IPv6Address) else (
            str(self.ip) if self.ip is not None else self.host)
        return f"{shown}:{self.port}"


def _ipv4_part(text: str) -> int | None:
    """One part of a loose IPv4 literal: decimal, 0x-hex or 0-prefixed octal, as inet_aton reads it."""
    if not text:
        return None
    lowered = text.lower()
    try:
        if lowered.startswith("0x"):
            return int(lowered[2:], 16) if lowered[2:] and all(c in "0123456789abcdef" for c in lowered[2:]) else None
        if len(text) > 1 and text.startswith("0"):
            return int(text[1:], 8) if all(c in "01234567" for c in text[1:]) else None
        return int(text, 10) if text.isdigit() and text.isascii() else None
    except ValueError:
        return None


def parse_ipv4_loose(text: str) -> ipaddress.IPv4Address | None:
    """Read ``text`` the way inet_aton does (1 to 4 parts, the last filling the remaining bytes)."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    parsed = [_ipv4_part(p) for p in parts]
    values = [v for v in parsed if v is not None]
    if len(values) < len(parsed):
        return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = 0
    for v in head:
        number = (number << 8) | v
    number = (number << (8 * (4 - len(head)))) | last
    return ipaddress.IPv4Address(number)


def canonical_ip(address: IPAddress) -> IPAddress:
    """IPv4-mapped IPv6 becomes the IPv4 address it reaches; anything else is returned unchanged."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_ip(text: str) -> IPAddress | None:
    """An address literal in any accepted spelling (brackets allowed for IPv6), canonicalised; else None."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if "%" in text:  # zone ids (fe80::1%eth0) are never a remote prefill pod
        return None
    if ":" in text:
        try:
            return canonical_ip(ipaddress.IPv6Address(text))
        except ValueError:
            return None
    return parse_ipv4_loose(text)


def is_hostname(text: str) -> bool:
    """True for a syntactically valid DNS name (labels of letters, digits, '-' and '_')."""
    name = text[:-1] if text.endswith(".") else text
    if not name or len(name) > 253:
        return False
    return all(_LABEL.match(label) for label in name.split("."))


def _parse_port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise TargetError(f"bad port {text!r}")
    return int(text)


def split_host_port(text: str, *, port_required: bool) -> tuple[str, int | None]:
    """Split ``host:port`` / ``[v6]:port`` / ``host`` / bare IPv6; raise TargetError when malformed."""
    text = text.strip()
    if not text:
        raise TargetError("empty host")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise TargetError(f"unclosed '[' in {text!r}")
        host, rest = text[: close + 1], text[close + 1:]
        if rest == "":
            port = None
        elif rest.startswith(":"):
            port = _parse_port(rest[1:])
        else:
            raise TargetError(f"unexpected {rest!r} after the address in {text!r}")
    elif text.count(":") > 1:  # bare IPv6, no port
        host, port = text, None
    elif ":" in text:
        host, port_text = text.rsplit(":", 1)
        port = _parse_port(port_text)
    else:
        host, port = text, None
    if port is None and port_required:
        raise TargetError(f"{text!r} names no port")
    return host, port


def parse_target(text: str, *, default_port: int | None = None) -> Target:
    """Parse a prefill target from ``x-prefiller-host-port`` (``host:port``) or a bare ``http(s)://host:port`` URL.

    URLs may carry nothing but scheme, host, port and an optional trailing ``/``: user info
    (``http://allowed@evil``), paths, queries and fragments are refused.
    """
    text = text.strip()
    scheme = None
    lowered = text.lower()
    if "://" in text:
        for candidate in ("http://", "https://"):
            if lowered.startswith(candidate):
                scheme = candidate[:-3]
                text = text[len(candidate):]
                break
        else:
            raise TargetError(f"unsupported scheme in {text!r}")
        if text.endswith("/"):
            text = text[:-1]
        if any(c in text for c in "/?#@\\"):
            raise TargetError("a prefill URL may hold only scheme, host and port")
        if default_port is None:
            default_port = 443 if scheme == "https" else 80
    if any(c in text for c in "/?#@\\ \t\r\n%") and not text.startswith("["):
        raise TargetError(f"malformed prefill target {text!r}")
    host, port = split_host_port(text, port_required=default_port is None)
    port = port if port is not None else default_port
    assert port is not None
    ip = parse_ip(host)
    if ip is None:
        if host.startswith("[") or ":" in host:
            raise TargetError(f"malformed IPv6 address {host!r}")
        if not is_hostname(host) or _NUMERIC_LABEL.match(host.rstrip(".").rsplit(".", 1)[-1]):
            # a name whose last label is numeric is an address literal that did not parse
            # (999.1.1.1, 1.2.3.4.5): resolvers disagree on such strings, so refuse it
            raise TargetError(f"malformed host {host!r}")
        host = host.lower().rstrip(".")
    return Target(host=host if ip is None else str(ip), port=port, ip=ip, scheme=scheme)


@dataclass(frozen=True, slots=True)
class AllowEntry:
    """One allowlist line: a network (single address or CIDR) or a name to resolve, with an optional port."""

    network: IPNetwork | None
    name: str | None
    port: int | None

    def matches(self, address: IPAddress, port: int) -> bool:
        """True when ``address`` (canonical) lies in this entry's network and the port agrees."""
        if self.network is None or (self.port is not None and self.port != port):
            return False
        return address.version == self.network.version and address in self.network


def _canonical_network(network: IPNetwork) -> IPNetwork:
    """An IPv4-mapped IPv6 network (``::ffff:10.0.0.0/104``) becomes the IPv4 network it covers."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_MAPPED):
        return ipaddress.IPv4Network((int(network.network_address) & 0xFFFFFFFF, network.prefixlen - 96))
    return network


def parse_allow_entry(text: str) -> AllowEntry:
    """Parse ``10.0.0.7``, ``10.0.0.0/8``, ``10.0.0.0/8:8000``, ``[fd00::/64]:8000``, ``fd00::1``, ``name[:port]``."""
    raw = text.strip()
    if "://" in raw:
        target_host, target_port = parse_target(raw).host_port.rsplit(":", 1)
        raw = f"{target_host}:{target_port}"
    host, port = split_host_port(raw, port_required=False)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "/" in bare:
        address, _, prefix = bare.partition("/")
        ip = parse_ip(address)
        if ip is None or not prefix.isdigit():
            raise TargetError(f"malformed network {bare!r}")
        raw_ip = ipaddress.ip_address(address) if ":" in address else ip
        try:
            network = ipaddress.ip_network(f"{raw_ip}/{prefix}", strict=False)
        except ValueError as exc:
            raise TargetError(f"malformed network {bare!r}: {exc}") from None
        return AllowEntry(_canonical_network(network), None, port)
    ip = parse_ip(bare)
    if ip is not None:
        return AllowEntry(ipaddress.ip_network(ip), None, port)
    if not is_hostname(bare):
        raise TargetError(f"malformed allowlist entry {text!r}")
    return AllowEntry(None, bare.lower().rstrip("."), port)

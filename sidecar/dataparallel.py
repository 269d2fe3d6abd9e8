"""Data-parallel decode pods: which of the local vLLM's engines (ranks) takes a request.

A vLLM pod started with ``--data-parallel-size N`` runs N engines. llm-d's sidecar, which this one
replaces, reaches them in one of two ways, and so does this one (``--data-parallel-mode``):

* ``external-lb``: vLLM runs one API server per rank, on the decoder port + r;
* ``internal-lb``: one API server for every rank; the request carries vLLM's ``X-data-parallel-rank``.

The sidecar listens on one port per rank (``--port`` + r), so a scheduler that sees each rank as
an endpoint (llm-d's) addresses rank r by port. A request that reaches the first port may instead
name its rank's endpoint in llm-d's deprecated ``x-data-parallel-host-port`` header (``POD_IP:PORT``,
the rank's sidecar port); a name that is not one of this pod's rank endpoints is refused (400), as
llm-d refuses it. The header can only choose among this pod's own engines, never another host.

kvroute's own router steers a rank with ``X-data-parallel-rank`` on the request it sends to the
first port; in ``internal-lb`` mode that header passes through unchanged on the first port, and the
rank ports set their own. In ``external-lb`` mode each of vLLM's API servers fronts one engine and
refuses any rank but 0 (vLLM 0.32: ``data_parallel_size_local`` is 1 there, and
``InputProcessor.process_inputs`` answers a rank out of range with a 400), so on the first port the
header picks the rank's API server, as a rank port does, and is not forwarded; a value that is not an
integer is ignored and one out of range refused (400), as vLLM reads it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

from sidecar.config import SidecarSettings
from sidecar.legs import DP_HOST_PORT_HEADER
from sidecar.targets import TargetError, parse_target

RANK_HEADER = "X-data-parallel-rank"
RANK_HEADER_BYTES = RANK_HEADER.lower().encode()
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower()


class RankError(ValueError):
    """The request names a data-parallel endpoint that is not one of this pod's."""


class DataParallel:
    """Where each rank of the local decoder is, and which rank a request is for."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.size = settings.data_parallel_size
        self.mode = settings.data_parallel_mode
        self.base_port = settings.port
        self.hosts = {_canonical(h) for h in (settings.pod_ip, settings.host, *_LOOPBACK)
                      if h and h not in ("0.0.0.0", "::")}
        parts = urlsplit(settings.vllm_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if self.mode == "external-lb" and port + self.size - 1 > 65535:
            raise ValueError(f"--vllm-url port {port} leaves no room for {self.size} per-rank API servers")
        host = parts.hostname or "127.0.0.1"
        shown = f"[{host}]" if ":" in host else host
        self._urls = [urlunsplit((parts.scheme, f"{shown}:{port + r}", parts.path, "", "")).rstrip("/")
                      if self.mode == "external-lb" else settings.vllm_url for r in range(self.size)]

    @property
    def ports(self) -> list[int]:
        """The ports the sidecar listens on: rank r on ``--port`` + r."""
        return [self.base_port + r for r in range(self.size)]

    def rank(self, scope) -> int | None:
        """The rank this request is for: named by llm-d's header, else by the port it arrived on, else
        (``external-lb``, first port) by ``X-data-parallel-rank``, which external-lb never forwards.

        None on the first port without either header (the decoder, or in ``internal-lb`` a rank header
        the request carries, decides). Raises ``RankError`` for a header that names no rank of this pod."""
        header_rank = self._take_rank_header(scope) if self.size > 1 and self.mode == "external-lb" else None
        named = [v for k, v in scope["headers"] if k.lower() == DP_HOST_PORT_HEADER]
        if named:
            raw = named[0].decode("latin-1").strip()
            try:
                target = parse_target(raw)
            except TargetError as exc:
                raise RankError(f"bad x-data-parallel-host-port {raw!r}: {exc}") from exc
            r = target.port - self.base_port
            host = str(target.ip) if target.ip is not None else target.host.lower()
            if host not in self.hosts or not 0 <= r < self.size or len(named) > 1:
                raise RankError(f"x-data-parallel-host-port {raw!r} is not a data-parallel endpoint of this pod")
            return r
        server = scope.get("server")
        if self.size > 1 and server and server[1] is not None:
            r = int(server[1]) - self.base_port
            if 0 < r < self.size:
                return r
        if header_rank is not None and not 0 <= header_rank < self.size:
            raise RankError(f"data_parallel_rank {header_rank} is out of range [0, {self.size}).")
        return header_rank

    def _take_rank_header(self, scope) -> int | None:
        """Drop the request's ``X-data-parallel-rank`` and answer the rank it names, read as vLLM reads
        it (not an integer: none)."""
        headers = scope["headers"]
        raw = [v for k, v in headers if k.lower() == RANK_HEADER_BYTES]
        if not raw:
            return None
        scope["headers"] = [(k, v) for k, v in headers if k.lower() != RANK_HEADER_BYTES]
        try:
            return int(raw[0].decode("latin-1"))
        except ValueError:
            return None

    def decoder(self, rank: int | None) -> tuple[str, list[tuple[str, str]]]:
        """(the decoder's base URL, headers to set) for a request to ``rank``."""
        if rank is None:
            return self._urls[0], []
        if self.mode == "internal-lb":
            return self._urls[rank], [(RANK_HEADER, str(rank))]
        return self._urls[rank], []

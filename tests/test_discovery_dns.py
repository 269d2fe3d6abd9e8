"""DNS discovery against a tiny DNS server on loopback UDP (stdlib only) that answers A and AAAA
records from a mapping the test changes; the resolved pod is a real simulated pod that serves."""

from __future__ import annotations

import asyncio
import ipaddress
import struct

import httpx
import pytest

from kvcommon.settings import build_settings
from router.config import RouterSettings
from router.discovery.dns import ResolveError, decode_answer, encode_query, system_resolve, udp_resolver
from simulator.testing import consecutive_free_ports, running_sims
from tests.helpers import free_port, until
from tests.test_router_api import running_router


class StubDNS(asyncio.DatagramProtocol):
    """Answers A/AAAA queries from ``records``; ``mode`` 'servfail' or 'silent' to misbehave."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.mode = "ok"
        self.queries = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.queries += 1
        if self.mode == "silent":
            return
        qid, _, _, _, _, _ = struct.unpack("!HHHHHH", data[:12])
        i, labels = 12, []
        while data[i]:
            labels.append(data[i + 1:i + 1 + data[i]].decode())
            i += 1 + data[i]
        question = data[12:i + 5]
        qtype = struct.unpack("!H", data[i + 1:i + 3])[0]
        name = ".".join(labels)
        if self.mode == "servfail":
            self.transport.sendto(struct.pack("!HHHHHH", qid, 0x8182, 1, 0, 0, 0) + question, addr)
            return
        if name not in self.records:
            self.transport.sendto(struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question, addr)  # NXDOMAIN
            return
        answers = b""
        count = 0
        for ip in self.records[name]:
            addr_obj = ipaddress.ip_address(ip)
            if (qtype == 1 and addr_obj.version == 4) or (qtype == 28 and addr_obj.version == 6):
                answers += b"\xc0\x0c" + struct.pack("!HHIH", qtype, 1, 5, len(addr_obj.packed)) + addr_obj.packed
                count += 1
        self.transport.sendto(struct.pack("!HHHHHH", qid, 0x8180, 1, count, 0, 0) + question + answers, addr)


@pytest.fixture
async def dns():
    loop = asyncio.get_running_loop()
    port = free_port()
    transport, stub = await loop.create_datagram_endpoint(StubDNS, local_addr=("127.0.0.1", port))
    stub.port = port
    yield stub
    transport.close()


def test_query_and_answer_wire_format():
    q = encode_query("vllm.kvroute.svc", 1, 0x1234)
    assert q[:2] == b"\x12\x34" and b"\x04vllm\x07kvroute\x03svc\x00" in q
    answer = struct.pack("!HHHHHH", 0x1234, 0x8180, 1, 1, 0, 0) + q[12:] + b"\xc0\x0c" + \
        struct.pack("!HHIH", 1, 1, 5, 4) + bytes([10, 0, 0, 7])
    assert decode_answer(answer, 0x1234) == ["10.0.0.7"]
    with pytest.raises(ResolveError):
        decode_answer(answer, 0x9999)  # not the answer to our question
    with pytest.raises(ResolveError):
        decode_answer(answer[:-3], 0x1234)  # truncated
    nx = struct.pack("!HHHHHH", 7, 0x8183, 0, 0, 0, 0)
    assert decode_answer(nx, 7) == []


async def test_system_resolver_finds_localhost():
    assert "127.0.0.1" in await system_resolve("localhost")


async def test_stub_resolver_answers_a_and_aaaa_and_tells_failure_from_absence(dns):
    resolve = udp_resolver(f"127.0.0.1:{dns.port}", timeout_s=0.3)
    dns.records["pods.test"] = ["10.0.0.1", "10.0.0.2", "fd00::1"]
    assert await resolve("pods.test") == ["10.0.0.1", "10.0.0.2", "fd00::1"]
    assert await resolve("missing.test") == []
    dns.mode = "servfail"
    with pytest.raises(ResolveError):
        await resolve("pods.test")
    dns.mode = "silent"
    with pytest.raises(ResolveError):
        await resolve("pods.test")


async def test_resolved_pods_join_serve_and_leave_and_a_failing_resolver_keeps_the_fleet(dns):
    events = consecutive_free_ports(2)
    with running_sims(1, ["--timing", "seed", "--kv-events-port", str(events), "--block-size", "16"]) as urls:
        http_port = int(urls[0].rsplit(":", 1)[1])
        dns.records["sim.test"] = ["127.0.0.1"]
        settings = build_settings(RouterSettings, dict(
            port=free_port(), discovery="dns", discovery_dns_name="sim.test",
            discovery_dns_server=f"127.0.0.1:{dns.port}", discovery_interval_s=0.1,
            discovery_http_port=http_port, discovery_kv_events_port=events,
            discovery_kv_events_replay_port=events + 1, discovery_model="sim-model",
            health_interval_s=0.1, scrape_interval_s=0.1, health_timeout_s=0.5, unhealthy_after=1,
            speculative_ttl_s=0.1))
        async with running_router(settings) as (base, services):
            assert set(services.registry.pods) == {"127.0.0.1"}
            async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                body = {"model": "sim-model", "prompt": "Resolved pods serve. " * 30, "max_tokens": 4}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "127.0.0.1"
                await until(lambda: (services.index.pod_stats("127.0.0.1") or {}).get("blocks", 0) > 0,
                            what="events indexed")

                dns.records["sim.test"] = ["127.0.0.1", "::1"]  # a second record: a second pod joins
                await until(lambda: set(services.registry.pods) == {"127.0.0.1", "::1"}, what="::1 joins")
                assert services.registry.pods["::1"].config.url == f"http://[::1]:{http_port}"

                dns.mode = "servfail"  # a failing resolver must not empty the fleet
                queries = dns.queries
                await until(lambda: dns.queries >= queries + 4, what="more lookups")
                assert set(services.registry.pods) == {"127.0.0.1", "::1"}
                assert services.fleet_sync.stats.errors.get("resolve", 0) >= 1

                dns.mode = "ok"
                dns.records["sim.test"] = ["::1"]  # the record went away: the pod leaves, index and all
                await until(lambda: set(services.registry.pods) == {"::1"}, what="127.0.0.1 leaves")
                assert not services.index.has_pod("127.0.0.1")
                del dns.records["sim.test"]  # NXDOMAIN: no pods at all
                await until(lambda: not services.registry.pods, what="empty fleet")
                r = await c.post("/v1/completions", json=body)
                assert r.status_code >= 400 and "error" in r.json()

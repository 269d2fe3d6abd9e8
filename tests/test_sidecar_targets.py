"""Prefill-target parsing, address normalisation and the allowlist, in-process (names resolved by a table)."""

from __future__ import annotations

import ipaddress
import random
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.allowlist import Allowlist, Snapshot, TargetResolver, parse_published_list
from sidecar.config import SidecarSettings
from sidecar.legs import decode_body, forward_headers, pick_prefill_target, prefill_body
from sidecar.proxy import SidecarApp
from sidecar.targets import TargetError, parse_allow_entry, parse_ipv4_loose, parse_target


@given(st.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_every_ipv4_spelling_is_the_same_address(number):
    address = ipaddress.IPv4Address(number)
    octets = str(address).split(".")
    spellings = [str(number), hex(number), "0" + oct(number)[2:] if number else "0",
                 ".".join("0" + oct(int(o))[2:] if int(o) else "0" for o in octets),
                 f"{octets[0]}.{int(octets[1]) * 65536 + int(octets[2]) * 256 + int(octets[3])}"]
    for text in spellings:
        assert parse_ipv4_loose(text) == address, text
        assert parse_target(f"{text}:80").ip == address
        # the C resolver reads the same spelling as the same address
        assert socket.inet_aton(text) == address.packed


@pytest.mark.parametrize("text", ["256.0.0.1", "1.2.3.4.5", "0x1g", "08.0.0.1", "4294967296", "1..2", "", "1.2.3."])
def test_strings_that_are_not_ipv4_are_not_read_as_ipv4(text):
    assert parse_ipv4_loose(text) is None


def test_ipv6_forms_normalise():
    assert parse_target("[::ffff:10.1.2.3]:8000").ip == ipaddress.IPv4Address("10.1.2.3")
    assert parse_target("[::FFFF:a01:203]:8000").ip == ipaddress.IPv4Address("10.1.2.3")
    assert parse_target("[fd00::0001]:8000").host_port == "[fd00::1]:8000"
    assert parse_target("Prefill-0.NS.svc.:8000").host == "prefill-0.ns.svc"
    for bad in ["fd00::1:8000", "[fd00::1", "[fd00::1]8000", "[fe80::1%eth0]:80", "a_b c:80", "http://u:p@h:80"]:
        with pytest.raises(TargetError):
            parse_target(bad)


def test_allow_entries_match_by_network_and_port():
    snapshot = Snapshot(tuple(parse_allow_entry(e) for e in
                              ["10.0.0.0/8:8000", "192.0.2.7", "[fd00::/64]:9000", "::ffff:198.51.100.0/120"]))
    ip = ipaddress.ip_address
    assert snapshot.allows(ip("10.9.9.9"), 8000)
    assert not snapshot.allows(ip("10.9.9.9"), 8001)
    assert snapshot.allows(ip("192.0.2.7"), 1)
    assert not snapshot.allows(ip("192.0.2.8"), 1)
    assert snapshot.allows(ip("fd00::5"), 9000) and not snapshot.allows(ip("fd00:1::5"), 9000)
    assert snapshot.allows(ip("198.51.100.9"), 80)


def test_published_list_format():
    assert parse_published_list(b'["10.0.0.1:8000", "p.svc:8000"]') == ["10.0.0.1:8000", "p.svc:8000"]
    assert parse_published_list(b'{"pods": ["10.0.0.1:8000"]}') == ["10.0.0.1:8000"]
    for bad in (b'{"x": 1}', b"[1, 2]", b'"a"'):
        with pytest.raises(ValueError):
            parse_published_list(bad)


def test_header_picking_first_of_repeated_and_comma_separated():
    headers = [(b"x-prefiller-host-port", b" , a:1, b:2"), (b"X-Prefiller-Host-Port", b"c:3")]
    assert pick_prefill_target(headers) == "a:1"
    assert pick_prefill_target([(b"x-prefiller-url", b"http://d:4")]) == "http://d:4"
    assert pick_prefill_target([(b"x-other", b"e:5")]) is None
    # llm-d's prefixed spelling wins over the others; with sampling any listed target may be taken
    both = [(b"x-prefiller-host-port", b"a:1"), (b"x-llm-d-prefiller-host-port", b"f:6, g:7")]
    assert pick_prefill_target(both) == "f:6"
    assert pick_prefill_target(both, sample=lambda n: n - 1) == "g:7"
    seen = {pick_prefill_target(headers, sample=random.Random(s).randrange) for s in range(64)}
    assert seen == {"a:1", "b:2", "c:3"}


def test_leg_bodies_for_the_responses_api_and_the_original_is_untouched():
    original = {"input": "hi", "max_output_tokens": 50, "stream": True}
    p = prefill_body(original, "/v1/responses")
    assert p["max_output_tokens"] == 1 and "max_tokens" not in p and p["stream"] is False
    assert original == {"input": "hi", "max_output_tokens": 50, "stream": True}
    assert decode_body({"a": 1, "kv_transfer_params": {"x": 1}}, None) == {"a": 1}
    assert decode_body({"a": 1}, {"remote_request_id": "r"}) == {"a": 1,
                                                                  "kv_transfer_params": {"remote_request_id": "r"}}


class Table:
    """A resolver answering from a dict, so a test can make a name resolve anywhere."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls = 0

    async def __call__(self, name: str):
        self.calls += 1
        if name not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in self.table[name]]


async def test_a_name_is_allowed_only_if_every_address_it_resolves_to_is():
    table = Table({"prefill.ok": ["10.1.1.1"], "prefill.mixed": ["10.1.1.1", "169.254.169.254"],
                   "prefill.evil": ["169.254.169.254"]})
    app = SidecarApp(SidecarSettings(prefill_allowlist=["10.0.0.0/8"]), resolver=table)
    assert await app._allowed_address(parse_target("prefill.ok:8000")) == "10.1.1.1"
    assert await app._allowed_address(parse_target("prefill.mixed:8000")) is None
    assert await app._allowed_address(parse_target("prefill.evil:8000")) is None
    assert await app._allowed_address(parse_target("unknown.name:8000")) is None
    assert app.metrics.ssrf_rejections.labels("not_allowed")._value.get() == 2
    assert app.metrics.ssrf_rejections.labels("unresolvable")._value.get() == 1


async def test_protection_off_connects_wherever_asked():
    app = SidecarApp(SidecarSettings(ssrf_protection=False), resolver=Table({}))
    assert await app._allowed_address(parse_target("0xa9fea9fe:80")) == "169.254.169.254"
    assert await app._allowed_address(parse_target("some.name:80")) == "some.name"


async def test_allowlisted_names_are_re_resolved_and_a_failure_keeps_the_last_addresses():
    table = Table({"prefill.svc": ["10.0.0.5"]})
    allowlist = Allowlist([], ["prefill.svc:8000"], None, resolver=table)
    await allowlist.refresh_dns()
    assert allowlist.snapshot.allows(ipaddress.ip_address("10.0.0.5"), 8000)
    assert not allowlist.snapshot.allows(ipaddress.ip_address("10.0.0.5"), 8001)
    table.table["prefill.svc"] = ["10.0.0.6"]
    await allowlist.refresh_dns()
    assert allowlist.snapshot.allows(ipaddress.ip_address("10.0.0.6"), 8000)
    assert not allowlist.snapshot.allows(ipaddress.ip_address("10.0.0.5"), 8000)
    del table.table["prefill.svc"]
    await allowlist.refresh_dns()
    assert allowlist.snapshot.allows(ipaddress.ip_address("10.0.0.6"), 8000)


async def test_target_names_are_cached_briefly():
    now = [0.0]
    table = Table({"p": ["10.0.0.1"]})
    resolver = TargetResolver(table, ttl_s=5, clock=lambda: now[0])
    await resolver.resolve("p")
    await resolver.resolve("p")
    assert table.calls == 1
    now[0] = 6
    await resolver.resolve("p")
    assert table.calls == 2


def test_bad_allowlist_entries_fail_at_start():
    with pytest.raises(ValueError, match="bad allowlist entries"):
        SidecarApp(SidecarSettings(prefill_allowlist=["10.0.0.0/33", "not a host"]))


def test_forwarded_headers_drop_hop_by_hop_ours_and_connection_listed_ones():
    headers = [(b"authorization", b"Bearer k"), (b"connection", b"keep-alive, X-Hop"), (b"x-hop", b"1"),
               (b"host", b"sidecar:8000"), (b"content-length", b"9"), (b"x-prefiller-host-port", b"a:1"),
               (b"x-prefiller-url", b"http://a:1"), (b"x-request-id", b"r"), (b"traceparent", b"00-ab-cd-01"),
               (b"transfer-encoding", b"chunked")]
    assert forward_headers(headers) == [("authorization", "Bearer k"), ("traceparent", "00-ab-cd-01")]


PREFILL_KEYS = [{"key": "sk-ops-4b7e19a2", "name": "ops", "admin": True}, {"key": "sk-team-0c93d5e1", "name": "team"}]


def _router_with_a_prefill_pod(pods, port: int, api_keys: list):
    from kvcommon.settings import build_settings
    from router.config import RouterSettings

    fleet = [{"id": "d0", "url": pods[0].url, "model": "m"},
             {"id": "p0", "url": "http://10.9.8.7:8100", "model": "m", "role": "prefill"}]
    return build_settings(RouterSettings, {"pods": fleet, "port": port, "api_keys": api_keys,
                                           "health_interval_s": 0.2})


@pytest.mark.e2e
async def test_the_published_set_of_a_router_with_api_keys_is_fetched_with_the_admin_key(caplog):
    """A router with API keys answers its prefill set to admin keys only: the allowlist's fetch sends
    --prefill-allowlist-key; without one, or with a key the router refuses, the refresh fails, is
    counted and keeps the last good list, and the log says why without the key."""
    import aiohttp

    from tests.helpers import free_port
    from tests.test_router_api import pods_running, running_router

    pod_ip, port = ipaddress.ip_address("10.9.8.7"), free_port()
    url = f"http://127.0.0.1:{port}/internal/prefill-pods"
    admin, tenant = PREFILL_KEYS[0]["key"], PREFILL_KEYS[1]["key"]
    errors: list[str] = []
    keyed = Allowlist([], [], url, url_key=admin, url_refresh_s=3600, on_refresh_error=errors.append)
    keyless = Allowlist([], [], url, url_refresh_s=3600, on_refresh_error=errors.append)
    async with pods_running(1) as pods, aiohttp.ClientSession() as session:
        async with running_router(_router_with_a_prefill_pod(pods, port, PREFILL_KEYS)):
            for allowlist in (keyed, keyless):
                await allowlist.start(session)
            assert keyed.snapshot.allows(pod_ip, 8100) and errors == ["url"]
            assert not keyless.snapshot.allows(pod_ip, 8100) and len(keyless.snapshot) == 0
            assert "needs a key and none is set" in caplog.text and "--prefill-allowlist-key" in caplog.text
        # the same router restarted with that key no longer an admin's: refused, counted, last list kept
        demoted = [{"key": admin, "name": "ops"}]
        async with running_router(_router_with_a_prefill_pod(pods, port, demoted)):
            await keyed.refresh_url()
            assert errors == ["url", "url"] and keyed.snapshot.allows(pod_ip, 8100)
            assert "refused the key of --prefill-allowlist-key (not an admin key)" in caplog.text
        for allowlist in (keyed, keyless):
            await allowlist.stop()
    assert admin not in caplog.text and tenant not in caplog.text


def test_the_allowlist_key_comes_from_the_environment_and_settings_never_show_it(monkeypatch):
    from kvcommon.settings import load_settings, settings_error

    monkeypatch.setenv("KVROUTE_SIDECAR_PREFILL_ALLOWLIST_KEY", "sk-ops-4b7e19a2")
    settings = load_settings(SidecarSettings, [], prog="kvroute sidecar", description="")
    assert settings.prefill_allowlist_key == "sk-ops-4b7e19a2" and "sk-ops" not in repr(settings)
    monkeypatch.delenv("KVROUTE_SIDECAR_PREFILL_ALLOWLIST_KEY")

    for bad in ("", "sk ops-4b7e19a2", "sk-ops-4b7e19a2\r\nX-Evil: 1"):
        with pytest.raises(ValueError) as refused:
            SidecarSettings(prefill_allowlist_key=bad)
        message = settings_error(refused.value)
        assert "prefill_allowlist_key" in message and "printable ASCII" in message
        assert not bad or bad not in message


@pytest.mark.e2e
async def test_the_sidecar_sends_its_allowlist_key_and_counts_a_refused_fetch():
    from tests.helpers import free_port
    from tests.test_router_api import pods_running, running_router

    pod_ip, port = ipaddress.ip_address("10.9.8.7"), free_port()
    url = f"http://127.0.0.1:{port}/internal/prefill-pods"
    async with pods_running(1) as pods, running_router(_router_with_a_prefill_pod(pods, port, PREFILL_KEYS)):
        for key, allowed, errors in ((PREFILL_KEYS[0]["key"], True, 0), (None, False, 1)):
            app = SidecarApp(SidecarSettings(prefill_allowlist_url=url, prefill_allowlist_key=key,
                                             allowlist_refresh_s=3600))
            await app.startup()
            try:
                assert app.allowlist.snapshot.allows(pod_ip, 8100) is allowed
                assert app.metrics.allowlist_refresh_errors.labels("url")._value.get() == errors
            finally:
                await app.shutdown()

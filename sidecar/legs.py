"""The rules of the two legs, as pure functions over headers and parsed JSON bodies.

The prefill (P) leg asks the prefill pod for one token with ``do_remote_decode`` set, so it keeps
the prompt's KV blocks for the decoder; the decode (D) leg sends the client's original body to the
local vLLM with the ``kv_transfer_params`` object P returned, verbatim (current vLLM needs
``remote_request_id`` and fields we do not know about, so it is never rebuilt).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from kvcommon.transfer import drop_client_params

PREFILL_HEADER = b"x-prefiller-host-port"
# llm-d's scheduler now writes the prefill target under a prefixed name too (both spellings)
LLMD_PREFILL_HEADER = b"x-llm-d-prefiller-host-port"
LEGACY_PREFILL_HEADER = b"x-prefiller-url"
PREFILL_HEADERS = (LLMD_PREFILL_HEADER, PREFILL_HEADER, LEGACY_PREFILL_HEADER)  # the first present one counts
REQUEST_ID_HEADER = b"x-request-id"
DP_HOST_PORT_HEADER = b"x-data-parallel-host-port"  # llm-d's (deprecated) rank endpoint: dataparallel.py

# paths served by the two-leg handler; everything else is proxied to the decoder unchanged
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})

# never forwarded: hop-by-hop headers (RFC 9110 7.6.1), the ones the proxy sets itself, and ours
_DROPPED_REQUEST_HEADERS = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
    b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
    *PREFILL_HEADERS, REQUEST_ID_HEADER, DP_HOST_PORT_HEADER,
})
_DROPPED_RESPONSE_HEADERS = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"server", b"date",
})

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """Every value of header ``name`` (lower-case bytes), split on commas, stripped, non-empty, in order."""
    values: list[str] = []
    for key, value in headers:
        if key.lower() == name:
            values.extend(v.strip() for v in value.decode("latin-1").split(","))
    return [v for v in values if v]


def prefill_targets(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The prefill targets the request names, in order: several header lines or one comma-separated
    line (RFC 9110 lets a proxy join them), under the first of ``PREFILL_HEADERS`` present."""
    for name in PREFILL_HEADERS:
        values = header_values(headers, name)
        if values:
            return values
    return []


def pick_prefill_target(headers: list[tuple[bytes, bytes]], sample: Callable[[int], int] | None = None) -> str | None:
    """The prefill target to use: the first one named (as llm-d's sidecar does by default), or with
    ``sample`` (llm-d's --enable-prefiller-sampling) the one at ``sample(len(targets))``."""
    targets = prefill_targets(headers)
    if not targets:
        return None
    return targets[sample(len(targets))] if sample is not None else targets[0]


def has_prefill_header(headers: list[tuple[bytes, bytes]]) -> bool:
    """True if a prefill header is present at all (even empty: an empty one is a malformed target)."""
    return any(key.lower() in PREFILL_HEADERS for key, _ in headers)


MAX_REQUEST_ID = 200


def sane_request_id(value: bytes) -> str | None:
    """A client's request id if it is short and printable ASCII (else None: a 60 KB id would make the
    decoder refuse the leg's headers)."""
    text = value.decode("latin-1").strip()
    if text and len(text) <= MAX_REQUEST_ID and text.isascii() and text.isprintable():
        return text
    return None


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id`` (first value, when sane) or a fresh one; both legs carry the same id."""
    for key, value in headers:
        if key.lower() == REQUEST_ID_HEADER:
            rid = sane_request_id(value)
            if rid is not None:
                return rid
            break
    return uuid.uuid4().hex


class BadBody(ValueError):
    """A request body the sidecar will not forward (it cannot read it as the engine would)."""


# Every digit as "0", every other byte as " " (bytes.translate: ten times faster than a re search).
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))


def _long_digit_run(raw: bytes) -> bool:
    """Whether ``raw`` holds 19 digits in a row, as many as the shortest integer orjson reads inexactly
    (it reads integers outside 64 bits as floats; -9223372036854775809 has 19 digits). Every 9th byte
    is looked at first: 19 digits in a row put two digits side by side there, and a body of prose
    (most chat bodies) has none, so only a body with many digits is translated whole."""
    return b"00" in raw[::9].translate(_DIGITS_AS_ZEROS) and b"0" * 19 in raw.translate(_DIGITS_AS_ZEROS)


def parse_body(raw: bytes) -> tuple[Any, bool]:
    """``raw`` parsed as the engine's HTTP server parses it, and whether the exact path was taken.

    vLLM's FastAPI calls Starlette's ``Request.json()``, which is ``json.loads`` on the bytes (NaN and
    Infinity, lone surrogates, UTF-16/32 and a UTF-8 BOM accepted, the last of duplicate keys wins,
    integers of any size). orjson reads it (fast) when the bytes hold no run of 19 digits and orjson
    accepts the document, which it then reads as ``json`` would; otherwise ``json.loads`` does and the
    second value is True: the object may hold what only ``json`` writes back as read (``write_body``).
    Raises ``BadBody``, also for a body nested deeper than ``json`` reads (RecursionError)."""
    if not _long_digit_run(raw):
        try:
            return orjson.loads(raw), False
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(raw), True
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadBody(f"request body is not valid JSON: {exc}") from None


def write_body(obj: Any, exact: bool, what: str = "request body") -> bytes:
    """``obj`` (from ``parse_body``) as the JSON bytes of a leg, read back by the engine as ``obj``.

    orjson writes it unless ``exact`` (it would write NaN as null, and refuses integers outside 64
    bits) or it refuses the object (nested deeper than its 255 levels); then Python's json does, ASCII
    only, NaN and Infinity as the engine's ``json.loads`` reads them. Raises ``BadBody`` naming
    ``what`` when neither can (nested deeper than Python's recursion limit)."""
    if not exact:
        try:
            return orjson.dumps(obj)
        except orjson.JSONEncodeError:
            pass
    try:
        return json.dumps(obj, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise BadBody(f"{what} cannot be written as JSON: {exc}") from None


def engine_json(raw: bytes) -> Any:
    """``raw`` parsed as the engine parses it (``parse_body``); raises ``BadBody``."""
    return parse_body(raw)[0]


def without_client_params(raw: bytes) -> bytes | None:
    """``raw`` re-serialised without a client's ``kv_transfer_params``, top-level and under
    ``vllm_xargs`` (``kvcommon.transfer.drop_client_params``; None when it has none). Parsed and
    written by ``parse_body`` and ``write_body``, so every other value (big integers, NaN, lone
    surrogates) reaches the engine as the engine would have read it from the original. Raises
    ``BadBody`` for a body that cannot be read or written."""
    parsed, exact = parse_body(raw)
    if not isinstance(parsed, dict) or not drop_client_params(parsed):
        return None
    return write_body(parsed, exact)


def normal_path(path: str) -> str:
    """A request path the way a permissive server might route it: slashes collapsed, dot segments
    resolved, trailing slashes dropped (``//v1/./completions/`` -> ``/v1/completions``)."""
    if not path.startswith("/"):
        path = "/" + path
    norm = posixpath.normpath("/" + path.lstrip("/"))
    return norm.rstrip("/") or "/"


def is_generation_path(path: str) -> bool:
    """Whether ``path`` may reach one of the engine's generation routes (any spelling)."""
    return normal_path(path) in GENERATION_PATHS


def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a ``Connection`` header lists: hop-by-hop for this message only (RFC 9110 7.6.1)."""
    return {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")}


def forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Client headers worth passing upstream (auth, content type, tracing), minus hop-by-hop and ours."""
    listed = _connection_tokens(headers)
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if k.lower() not in _DROPPED_REQUEST_HEADERS and k.lower() not in listed]


def response_headers(raw: Any) -> list[tuple[bytes, bytes]]:
    """Upstream response headers to relay (iterable of (name, value) bytes), minus hop-by-hop ones."""
    return [(k.lower(), v) for k, v in raw if k.lower() not in _DROPPED_RESPONSE_HEADERS]


# the strings pydantic's lax bool reads as true (vLLM's request models read ``stream`` so)
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def is_streamed(body: dict[str, Any]) -> bool:
    """Whether vLLM answers ``body`` as a stream: its ``stream`` read as pydantic reads a bool."""
    value = body.get("stream")
    if isinstance(value, str):
        return value.lower() in _TRUE_STRINGS
    return value is True or (type(value) in (int, float) and value == 1)


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The P-leg body: one token, not streamed, no minimum, with the remote-decode transfer request."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    if path == "/v1/responses":
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The D-leg body: the original request plus P's params verbatim, or none at all when P returned none."""
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    else:
        out.pop("kv_transfer_params", None)
    return out

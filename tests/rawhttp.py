"""Raw HTTP/1.x over a socket, for tests that must send exactly the bytes an attacker would."""

from __future__ import annotations

import json
import socket
import time


def exchange(port: int, data: bytes, timeout: float = 10.0, host: str = "127.0.0.1") -> bytes:
    """Send ``data`` and read until the server closes or one whole response (by Content-Length) is in."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        return read_response(s, timeout)


def read_response(s: socket.socket, timeout: float = 10.0) -> bytes:
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and len(rest) >= int(value.strip()):
                    return buf
    return buf


def status(response: bytes) -> int:
    """The status code of a raw response (0 when there is none)."""
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else 0


def body(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


def error(response: bytes) -> dict:
    """The OpenAI-style error object of a raw response (asserting its shape)."""
    err = json.loads(body(response))["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status(response), err
    return err


def post(path: str, payload: bytes, headers: dict[str, str] | None = None, version: str = "1.1") -> bytes:
    """The bytes of a POST with ``payload`` as its body (Content-Length set, connection closed after)."""
    lines = [f"POST {path} HTTP/{version}", "Host: x", f"Content-Length: {len(payload)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {"Content-Type": "application/json"}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload

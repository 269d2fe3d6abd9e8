"""The listener's transport wrapper: a response head leaves with the body written in the same turn."""

from __future__ import annotations

import asyncio
from typing import Any

from kvcommon.listener import OneWriteResponses


class Recording:
    """A transport that records each system-call-sized write (a ``writelines`` is one)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sent.append(bytes(data))

    def writelines(self, data: Any) -> None:
        assert not self.closed
        self.sent.append(b"".join(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


async def test_a_head_and_its_body_leave_in_one_write_and_a_lone_head_at_the_end_of_the_turn():
    loop = asyncio.get_running_loop()
    raw = Recording()
    t = OneWriteResponses(raw, loop)

    t.write(HEAD)
    assert raw.sent == [] and t.get_write_buffer_size() == len(HEAD)  # held
    t.write(b"hello")
    assert raw.sent == [HEAD + b"hello"]
    await asyncio.sleep(0)
    assert raw.sent == [HEAD + b"hello"]  # the flush at the end of the turn found nothing held

    # a stream: its head goes out at the end of the turn, before the first chunk is ready
    t.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    await asyncio.sleep(0)
    assert len(raw.sent) == 2 and raw.sent[1].startswith(b"HTTP/1.1 200 OK")
    t.write(b"5\r\nhello\r\n")  # not a head: straight through
    assert raw.sent[2] == b"5\r\nhello\r\n"


async def test_close_sends_a_held_head_first_and_abort_drops_it():
    loop = asyncio.get_running_loop()
    raw = Recording()
    t = OneWriteResponses(raw, loop)
    t.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n\r\n")
    t.close()
    assert raw.closed and raw.sent and raw.sent[0].startswith(b"HTTP/1.1 431")

    raw = Recording()
    t = OneWriteResponses(raw, loop)
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert raw.aborted and raw.sent == []

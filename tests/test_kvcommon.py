"""kvcommon's ASGI body reader, disconnect waits and error builder, on hand-made ASGI messages."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kvcommon.asgi import WATCH_EXTENSION, ClientWatch, header, read_body, unless_disconnected, wait_for_disconnect
from kvcommon.errors import APIError, ClientDisconnected, error_body, error_payload


def scope(content_length: str | None = None) -> dict:
    headers = [(b"host", b"x")]
    if content_length is not None:
        headers.append((b"content-length", content_length.encode()))
    return {"type": "http", "headers": headers}


def receiver(*messages: dict, then_wait: bool = False):
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    return receive


def chunk(data: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


async def test_the_body_arrives_whole_from_its_chunks():
    got = await read_body(scope("6"), receiver(chunk(b"abc", True), chunk(b"", True), chunk(b"def", False)), 6)
    assert got == b"abcdef"
    assert await read_body(scope(), receiver(chunk(b"", False)), 0) == b""


@pytest.mark.parametrize("declared", ["7", "100000000000"])
async def test_a_declared_length_over_the_limit_is_413_before_reading(declared):
    def never():
        raise AssertionError("the body must not be read")

    with pytest.raises(APIError) as err:
        await read_body(scope(declared), never, 6)
    assert err.value.status == 413 and "6-byte limit" in err.value.message


async def test_more_bytes_than_the_limit_is_413_even_without_a_declared_length():
    with pytest.raises(APIError) as err:
        await read_body(scope(), receiver(chunk(b"abcd", True), chunk(b"efg", False)), 6)
    assert err.value.status == 413


async def test_an_invalid_content_length_is_400():
    with pytest.raises(APIError) as err:
        await read_body(scope("12x"), receiver(chunk(b"a", False)), 6)
    assert err.value.status == 400 and err.value.message == "invalid Content-Length"


async def test_a_body_slower_than_the_deadline_is_408():
    with pytest.raises(APIError) as err:
        await read_body(scope(), receiver(chunk(b"a", True), then_wait=True), 6, timeout_s=0.05)
    assert err.value.status == 408 and not isinstance(err.value, ClientDisconnected)


async def test_a_body_the_listener_already_holds_is_read_without_a_deadline():
    async def late() -> dict:  # later than the deadline below: only a deadline makes it a 408
        await asyncio.sleep(0.1)
        return chunk(b"abc", False)

    held, watch = watched()
    watch.received = True  # kvroute's listener says the whole body is in
    assert await read_body(held, late, 6, timeout_s=0.02) == b"abc"
    pending, watch = watched()  # not yet: the deadline holds
    with pytest.raises(APIError) as err:
        await read_body(pending, late, 6, timeout_s=0.02)
    assert err.value.status == 408


async def test_a_client_that_leaves_mid_body_is_client_disconnected_a_400():
    with pytest.raises(ClientDisconnected) as err:
        await read_body(scope(), receiver(chunk(b"a", True)), 6, timeout_s=5)
    assert isinstance(err.value, APIError) and err.value.status == 400


async def test_wait_for_disconnect_returns_on_the_disconnect_only():
    seen = []
    messages = [chunk(b"", False), {"type": "http.disconnect"}]

    async def receive() -> dict:
        seen.append(messages[len(seen)])
        return seen[-1]

    await asyncio.wait_for(wait_for_disconnect(receive), 1)
    assert len(seen) == 2


class Work:
    """An awaitable job that records whether it finished or was cancelled."""

    def __init__(self, delay: float, value: str = "done") -> None:
        self.delay, self.value, self.outcome = delay, value, "not started"

    async def run(self) -> str:
        self.outcome = "running"
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        self.outcome = "finished"
        return self.value


def watched() -> tuple[dict, ClientWatch]:
    watch = ClientWatch()
    return {"type": "http", "headers": [], "extensions": {WATCH_EXTENSION: {"watch": watch}}}, watch


async def never_called() -> dict:
    raise AssertionError("with a watch in the scope, receive is not polled")


async def test_unless_disconnected_returns_the_work_s_value_and_leaves_no_task_behind():
    for sc, receive in ((watched()[0], never_called), (scope(), receiver(then_wait=True))):
        before = len(asyncio.all_tasks())
        work = Work(0.01, "answer")
        assert await unless_disconnected(sc, receive, work.run()) == "answer"
        await asyncio.sleep(0)  # a poller's cancellation completes
        assert work.outcome == "finished" and len(asyncio.all_tasks()) == before


async def test_the_watch_firing_cancels_the_work_and_the_handler_goes_on_uncancelled():
    sc, watch = watched()
    work = Work(3600)
    asyncio.get_running_loop().call_later(0.02, watch.lost)  # as the listener does on connection loss
    async with asyncio.timeout(2):  # no task of its own (wait_for's would hide this task's count)
        got = await unless_disconnected(sc, never_called, work.run())
    task = asyncio.current_task()
    assert got is None
    assert work.outcome == "cancelled" and task is not None and task.cancelling() == 0
    await asyncio.sleep(0.001)  # the handler can still await: its task was not left cancelled


async def test_whatever_the_work_does_with_the_watch_s_cancel_the_handler_goes_on_uncancelled():
    async def fails_on_the_way_out() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionResetError("clean-up hit the closed socket") from None
        return "unreachable"

    async def absorbs_it() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "finished anyway"
        return "unreachable"

    for job, want in ((fails_on_the_way_out, None), (absorbs_it, "finished anyway")):
        sc, watch = watched()
        asyncio.get_running_loop().call_later(0.01, watch.lost)
        async with asyncio.timeout(2):
            got = await unless_disconnected(sc, never_called, job())
        task = asyncio.current_task()
        assert got == want and task is not None and task.cancelling() == 0


async def test_without_a_watch_a_disconnect_on_receive_cancels_the_work():
    work = Work(3600)
    got = await asyncio.wait_for(unless_disconnected(scope(), receiver(chunk(b"", False)), work.run()), 2)
    assert got is None and work.outcome == "cancelled"


async def test_a_client_gone_before_the_work_starts_never_starts_it():
    sc, watch = watched()
    watch.lost()
    work = Work(3600)
    assert await unless_disconnected(sc, never_called, work.run()) is None
    assert work.outcome == "not started"


async def test_a_cancellation_from_elsewhere_propagates_even_when_the_client_also_left():
    for client_leaves in (False, True):
        sc, watch = watched()
        work = Work(3600)
        handler = asyncio.ensure_future(unless_disconnected(sc, never_called, work.run()))
        await asyncio.sleep(0.01)
        handler.cancel()  # a server shutting down
        if client_leaves:
            watch.lost()
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert work.outcome == "cancelled"


def test_one_error_shape_with_a_type_per_status_unless_named():
    assert orjson.loads(error_body(413, "too big")) == {
        "error": {"message": "too big", "type": "RequestTooLargeError", "param": None, "code": 413}}
    assert error_payload(503, "down", err_type="ServiceUnavailable")["error"]["type"] == "ServiceUnavailable"
    assert error_payload(400, "bad", param="prompt", code="x")["error"] == {
        "message": "bad", "type": "BadRequestError", "param": "prompt", "code": "x"}
    assert error_payload(599, "?")["error"]["type"] == "APIError"


def test_router_errors_are_kvcommons():
    from router import errors

    assert errors.APIError is APIError and errors.error_body is error_body


def test_header_is_the_first_value_or_none():
    s = {"headers": [(b"a", b"1"), (b"a", b"2")]}
    assert header(s, b"a") == "1" and header(s, b"b") is None

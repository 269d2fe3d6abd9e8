"""Relaying server-sent events whole (the router's stream relay and the sidecar's decode leg).

A pod's stream can break anywhere, inside an event too: its process dies, its connection resets, a
read times out. The relay then ends the client's stream with an error event of its own. Had it
passed on every byte as it came, a client would have half an event and then the error, run
together into one event by its parser (the SSE format joins everything up to a blank line), and the
OpenAI SDK raises a JSON decoding error on that mixture instead of the relay's message. So the relay
passes on only whole events: ``EventFramer`` holds back the bytes after the last event boundary of
what came, until the rest of that event comes. vLLM writes one or more whole events per network
write, so almost every chunk ends at a boundary and passes at once, with a suffix test as its cost
(on the router's own listener the chunk writer is the framer: ``kvcommon.listener.ChunkWriter``).
"""

from __future__ import annotations

import orjson

from kvcommon.errors import error_body

# the Anthropic Messages API's route, whose clients read another error event (``error_event``)
MESSAGES_PATH = "/v1/messages"

# where an event ends: a blank line after a line. vLLM (Starlette) ends lines with "\n"; the format
# also allows "\r\n" and "\r", and "\r\n\r\n" ends in "\n\r\n"
BOUNDARIES = (b"\n\n", b"\n\r\n", b"\r\r")
# an event this long is passed on unfinished rather than held: a bound on what one stream keeps
MAX_HELD_BYTES = 1 << 20


class EventFramer:
    """The whole events of a stream's chunks, in order: ``whole(chunk)`` is what may be passed on now
    (possibly empty), and ``held`` the start of an event not yet complete, which ``rest`` hands over at
    the stream's normal end (a last event without its blank line) and a broken stream drops."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = b""

    def whole(self, data: bytes) -> bytes:
        if self.held:
            data = self.held + data
            self.held = b""
        if data.endswith(BOUNDARIES) or not data:
            return data
        end = 0
        for sep in BOUNDARIES:
            at = data.rfind(sep)
            if at >= 0:
                end = max(end, at + len(sep))
        if len(data) - end > MAX_HELD_BYTES:  # an event past the bound: passed on as it is
            return data
        self.held = data[end:]
        return data[:end]

    def rest(self) -> bytes:
        held, self.held = self.held, b""
        return held



def error_event(path: str, status: int, message: str, err_type: str | None = None) -> bytes:
    """The event a relay ends a stream with when the pod's broke: the one its route's clients raise
    on. On the Messages route it is vLLM 0.32's own, ``event: error`` with ``{"type": "error",
    "error": {"type": "internal_error", "message"}}`` (``message_stream_converter``,
    vllm/entrypoints/anthropic/serving.py) and no ``[DONE]``: Anthropic's SDK skips an event with no
    name, so an OpenAI error there would end the client's stream as if it were whole. Elsewhere the
    OpenAI error object as a ``data`` event, then ``[DONE]`` (the OpenAI SDK raises on the first)."""
    if path == MESSAGES_PATH:
        return (b"event: error\ndata: "
                + orjson.dumps({"type": "error", "error": {"type": "internal_error", "message": message}})
                + b"\n\n")
    return b"data: " + error_body(status, message, err_type=err_type) + b"\n\ndata: [DONE]\n\n"

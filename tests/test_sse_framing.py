"""kvcommon/sse.py: a relayed stream passes on whole events only, whatever its chunks' boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcommon.sse import BOUNDARIES, MAX_HELD_BYTES, EventFramer

EVENT_TEXT = st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=40)


@st.composite
def streams(draw) -> tuple[bytes, list[int]]:
    """A stream of whole events (any of the format's line endings) and the points it is cut at."""
    ending = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    events = draw(st.lists(EVENT_TEXT, min_size=1, max_size=8))
    data = b"".join(b"data: " + e.encode() + ending + ending for e in events)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=10)))
    return data, cuts


def chunks_of(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=300, deadline=None)
@given(streams())
def test_whole_events_pass_in_order_and_a_break_leaves_none_cut(stream):
    data, cuts = stream
    framer = EventFramer()
    passed = b""
    for piece in chunks_of(data, cuts):
        out = framer.whole(piece)
        passed += out
        # what has passed ends at an event boundary, or is nothing yet
        assert not passed or passed.endswith(BOUNDARIES), (passed, piece)
        assert data.startswith(passed)
    assert passed + framer.rest() == data


def test_a_last_event_without_its_blank_line_is_handed_over_at_the_end():
    framer = EventFramer()
    assert framer.whole(b"data: 1\n\ndata: [DONE]\n") == b"data: 1\n\n"
    assert framer.held == b"data: [DONE]\n" and framer.rest() == b"data: [DONE]\n" and framer.held == b""


def test_an_event_past_the_bound_is_passed_on_unfinished():
    framer = EventFramer()
    big = b"data: " + b"x" * (MAX_HELD_BYTES + 1)
    assert framer.whole(big) == big and framer.held == b""

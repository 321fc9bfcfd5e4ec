"""services.llm.marker: a marker taken out of streamed text, however the deltas split it (pure).

The filter holds back a trailing piece that could still become the marker, drops each complete
marker and releases the rest; what it lets through, put together, is `without_marker` of the
whole text, and never holds the marker.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.llm.marker import MarkerFilter, without_marker

MARKER = "[[HANDOFF]]"
FAST = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def run(deltas: list[str], marker: str = MARKER) -> tuple[list[str], MarkerFilter]:
    """What each delta releases, then what the end of the stream releases."""
    f = MarkerFilter(marker)
    return [f.feed(d) for d in deltas] + [f.flush()], f


def splits_of(text: str) -> list[list[str]]:
    """`text` cut in two at every position."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)]


@pytest.mark.parametrize(("deltas", "released", "found"), [
    # the marker whole in one delta, alone or with text around it
    (["[[HANDOFF]]"], ["", ""], True),
    (["One moment. [[HANDOFF]]"], ["One moment. ", ""], True),
    (["[[HANDOFF]] Bye."], [" Bye.", ""], True),
    # split across deltas: nothing of it goes out, the text after it does
    (["One moment. [[HAND", "OFF]]"], ["One moment. ", "", ""], True),
    (["[", "[", "H", "A", "N", "D", "O", "F", "F", "]", "]"], [""] * 12, True),
    (["Sure [[HANDOFF", "]] someone will reply"], ["Sure ", " someone will reply", ""], True),
    # a false start is released as soon as it is ruled out
    (["[[HANDY", " is a name"], ["[[HANDY", " is a name", ""], False),
    (["[[HAND", "Y"], ["", "[[HANDY", ""], False),
    (["see [1]"], ["see [1]", ""], False),
    # a possible start at the end of the stream is released by the flush
    (["look at this [["], ["look at this ", "[["], False),
    (["[[HANDOFF]"], ["", "[[HANDOFF]"], False),
    # two markers, and markers that only appear once another is taken out
    (["a[[HANDOFF]]b[[HAND", "OFF]]c"], ["ab", "c", ""], True),
    (["[[HAN[[HANDOFF]]DOFF]]"], ["", ""], True),
    (["[[HAN[[", "HANDOFF]]DOFF]] ok"], ["", " ok", ""], True),
    # text with no bracket goes straight through
    (["Hello", " there"], ["Hello", " there", ""], False),
])
def test_the_filter_releases_what_cannot_be_the_marker_and_drops_the_marker(deltas, released, found):
    out, f = run(deltas)
    assert out == released
    assert f.found is found


@pytest.mark.parametrize("deltas", splits_of("Let me get someone. [[HANDOFF]] Thanks."))
def test_a_marker_split_at_any_position_never_goes_out(deltas):
    out, f = run(deltas)
    assert "".join(out) == "Let me get someone.  Thanks." and f.found
    assert all(MARKER not in "".join(out[:i]) for i in range(len(out) + 1))


@pytest.mark.parametrize("deltas", splits_of("Try [[HANDY]] or [[ later"))
def test_a_false_start_split_at_any_position_is_released_whole(deltas):
    out, f = run(deltas)
    assert "".join(out) == "Try [[HANDY]] or [[ later" and not f.found


def test_nothing_is_released_before_it_is_ruled_out_and_the_flush_empties_the_filter():
    f = MarkerFilter(MARKER)
    assert f.feed("ok [[HA") == "ok "
    assert f.feed("N") == ""
    assert f.flush() == "[[HAN"
    assert f.flush() == ""  # nothing held any more


def test_a_marker_whose_start_repeats_its_end_is_refused():
    # the filter's output is `without_marker` of the whole only for markers with no such overlap
    with pytest.raises(ValueError, match="'abab' begins as it ends"):
        MarkerFilter("abab")
    with pytest.raises(ValueError, match="empty"):
        MarkerFilter("")


@pytest.mark.parametrize(("text", "clean"), [
    ("One moment. [[HANDOFF]]", "One moment. "),
    ("[[HAN[[HANDOFF]]DOFF]]", ""),
    ("[[HANDY", "[[HANDY"),
    ("no marker", "no marker"),
])
def test_without_marker_takes_out_every_marker_until_none_is_left(text, clean):
    assert without_marker(text, MARKER) == clean


#: text built from pieces of the marker, so markers, near misses and nested ones are common
PIECES = st.sampled_from(["[", "]", "[[", "]]", "HAND", "OFF", "[[HAND", "OFF]]", MARKER, "HANDY", " ", "a", "\n"])
TEXTS = st.lists(PIECES, max_size=12).map("".join)


@FAST
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6))
def test_any_split_releases_the_text_without_the_marker_and_never_the_marker(text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    out, f = run(deltas)
    assert "".join(out) == without_marker(text, MARKER)
    assert f.found is (MARKER in text)
    for i in range(len(out) + 1):  # at no moment has the watcher read the marker
        assert MARKER not in "".join(out[:i])

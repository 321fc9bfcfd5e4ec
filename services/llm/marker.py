"""A control marker in the model's text (the session's `[[HANDOFF]]`) taken out before anyone
reads it, streamed or whole. Pure: no I/O.

Owns
- `without_marker`: a whole text with every marker taken out, again until none is left (taking
  one out of `[[HAN[[HANDOFF]]DOFF]]` makes another);
- `defused`: a whole text with every marker made into a plain word (`[HANDOFF]`), for text a
  person wrote: kept, but never the marker;
- `MarkerFilter`: the same over a stream of text deltas, however they split the marker. It holds
  back the trailing text that could still become a marker and releases it once ruled out (or at
  the end of the stream), so what it lets through, put together, is `without_marker` of the whole
  text, and at no moment holds the marker.
"""

from __future__ import annotations


def without_marker(text: str, marker: str) -> str:
    """`text` with every `marker` taken out, until none is left."""
    while marker in text:
        text = text.replace(marker, "")
    return text


def defused(text: str, marker: str) -> str:
    """`text` with every `marker` shortened by its first and last character, until none is left
    (`[[[HANDOFF]]]` shortened once is the marker again): what a person wrote stays readable."""
    while marker in text:
        text = text.replace(marker, marker[1:-1])
    return text


class MarkerFilter:
    """Text deltas in, the text a reader may see out: `feed` each delta and send on what it
    returns, then send on what `flush` returns when the stream ends. `found` says whether a
    marker was taken out.

    What is held back is the longest end of the text seen so far that is a run of beginnings of
    the marker (`[[HAND`, or `[[HAN[[`, which becomes a marker if `HANDOFF]]DOFF]]` follows): a
    marker completed later may take out any of it, and nothing before it. Released text is never
    taken back, so the marker may not begin as it ends (no `abab`): taking markers out of such a
    marker's text depends on where one starts looking, and a stream cannot look back.
    """

    __slots__ = ("_held", "_marker", "found")

    def __init__(self, marker: str) -> None:
        if not marker:
            raise ValueError("the marker is empty; give the text to take out, e.g. '[[HANDOFF]]'")
        if any(marker[:k] == marker[-k:] for k in range(1, len(marker))):
            raise ValueError(f"marker {marker!r} begins as it ends; a stream cannot be filtered of it alike "
                             "however it is split: choose a marker without such an overlap")
        self._marker = marker
        self._held = ""
        self.found = False

    def feed(self, delta: str) -> str:
        """What of the text so far may be shown now that `delta` came: possibly ""."""
        text = self._held + delta
        if self._marker in text:
            self.found = True
            text = without_marker(text, self._marker)
        start = _run_of_beginnings(text, self._marker)
        self._held = text[start:]
        return text[:start]

    def flush(self) -> str:
        """The end of the stream: what was held back, now that no marker can complete."""
        rest, self._held = self._held, ""
        return rest


def _run_of_beginnings(text: str, marker: str) -> int:
    """Where the longest end of `text` begins that is a run of proper beginnings of `marker`
    (`len(text)` when none is). Scans back from the end and stops once no run can reach further:
    a beginning is shorter than the marker."""
    n = len(text)
    longest = len(marker) - 1
    runs = {n}  # the positions from which the rest of `text` is such a run ("" is)
    start = n
    for i in range(n - 1, -1, -1):
        if start - i > longest:
            break
        k = 0
        while k < longest and i + k < n and text[i + k] == marker[k]:
            k += 1
            if i + k in runs:
                runs.add(i)
                start = i
                break
    return start

"""Incremental detokenization and stop strings for one generation.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas whose concatenation
is ``decode(all ids)``: a delta is released only when the decoded text does not end in U+FFFD, so
a UTF-8 character whose bytes span several tokens is never split (at the end, ``flush`` releases
whatever is left, replacement characters included). It decodes a window that starts at an earlier
clean boundary, so tokenizers that drop a leading space when decoding alone stay exact.

``StopStrings`` finds the first stop string in the generated text and holds back the last
``max(len(stop)) - 1`` characters, which could still become the start of one, so no text after a
stop string is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``decode(ids) -> str`` applied incrementally to ``ids`` that only ever grow."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window (a clean boundary)
        self.read_offset = 0  # ids before this are already in the released text

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; the text they complete (maybe "")."""
        self.ids.extend(int(t) for t in new_ids)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """The text of the ids not yet released (at the end of the generation)."""
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopStrings:
    """The generated text, cut at the first stop string; ``add`` returns what may be sent."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # all text so far (cut at the stop once found)
        self.sent = 0  # characters of ``text`` already released
        self.stopped: str | None = None  # the stop string found

    def add(self, delta: str, *, final: bool = False) -> str:
        """Append ``delta``; the releasable text. ``final``: release the held-back tail too."""
        if self.stopped is not None:
            return ""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            cut, self.stopped = min(hits)
            self.text = self.text[:cut]
            final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

"""Stop strings over streamed text: what may be emitted now, what is held back, and where the output ends.

A stop string may span several tokens, so text that could still be the start of one is held back until the
next delta decides it. The output never contains a stop string. Generation stops on the first delta that
completes an occurrence; when that delta completes several, the one that starts earliest in the text wins.
Pure Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopCheck:
    """text is safe to emit now. stopped: a stop string was found; text ends just before it, and nothing more
    may be emitted for this sequence."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Feeds on the text deltas of one sequence. Holds back the longest suffix of the text seen so far that is a
    prefix of some stop string (never a fixed length), so emitted text is final.

    stops: the stop strings (a single str is taken as one stop string). Raises ValueError on an empty one.
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = (stops,) if isinstance(stops, str) else tuple(stops)
        if any(not s for s in self._stops):
            raise ValueError("stop strings must not be empty")
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopCheck:
        """delta: the newly detokenized text of one token (may be ''). After a stop, returns StopCheck('', True)."""
        if self._stopped:
            return StopCheck("", True)
        if not self._stops:
            return StopCheck(delta, False)
        # Text already emitted cannot start an occurrence: it would have been part of the held suffix.
        text = self._held + delta
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self._held, self._stopped = "", True
            return StopCheck(text[:min(found)], True)
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep:]
        return StopCheck(text[:len(text) - keep], False)

    def flush(self) -> str:
        """At the end of the stream when no stop was found: the text still held back ('' after a stop)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best

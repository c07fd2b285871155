"""Stop strings: cut the output exactly before the first stop string, across chunk edges.

Text that could still be the start of a stop string is held back until the next chunk
decides it, so a client never sees half of a stop string.

Linear in the text: each chunk is searched once (``str.find`` over the held-back tail and
the new text), and how much to hold back comes from one Knuth-Morris-Pratt automaton per
stop string, fed each new character once; nothing is rescanned per stop-string length.
"""

from __future__ import annotations

from collections.abc import Sequence


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its
    suffix (KMP's failure function)."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class _PrefixTracker:
    """How many of the last characters seen are a prefix of ``stop`` (proper, while no
    match has been seen)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self._fail = _prefix_function(stop)
        self.state = 0

    def feed(self, text: str) -> None:
        stop, fail, k, n = self.stop, self._fail, self.state, len(self.stop)
        for ch in text:
            while k and (k == n or stop[k] != ch):
                k = fail[k - 1]
            if stop[k] == ch:
                k += 1
        self.state = k


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str], *, include_stop: bool = False) -> None:
        assert all(stop_strings), "empty stop strings are rejected at validation"
        self._stops = tuple(stop_strings)
        self._trackers = [_PrefixTracker(s) for s in self._stops]
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output
        self._held = ""
        self.is_stopped = False

    def push(self, text: str) -> str:
        """The part of ``text`` safe to emit now; sets ``is_stopped`` at a stop string."""
        if self.is_stopped:
            return ""
        buffer = self._held + text
        # The earliest match wins; at one position, the longest stop string.
        matches = [(i, -len(s)) for s in self._stops if (i := buffer.find(s)) >= 0]
        if matches:
            cut, minus_length = min(matches)
            self.is_stopped = True
            self._held = ""
            return buffer[: cut - minus_length] if self._include_stop else buffer[:cut]
        # No stop string in the buffer: each tracker's state is the longest suffix of the
        # text so far that is a proper prefix of its stop string, and lies in the buffer.
        keep = 0
        for tracker in self._trackers:
            tracker.feed(text)
            keep = max(keep, tracker.state)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation, what was held back is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

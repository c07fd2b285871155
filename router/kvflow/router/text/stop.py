"""Stop strings: cut the output exactly before the first stop string, across chunk edges.

Text that could still be the start of a stop string is held back until the next chunk
decides it, so a client never sees half of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str], *, include_stop: bool = False) -> None:
        assert all(stop_strings), "empty stop strings are rejected at validation"
        self._stops = tuple(stop_strings)
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output
        self._held = ""
        self.is_stopped = False

    def _held_back_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

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
        keep = self._held_back_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation, what was held back is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

"""The live view's keys: ``q`` quits; in a big swarm (:mod:`monitor.crowd`) the arrows, pages,
Home and End scroll the whole peer table, and ``a`` (or Esc) goes back to the overview.

Keys arrive as the bytes a terminal in cbreak mode sends (:class:`monitor.app.LiveApp` reads
them); :func:`parse_keys` names them, :class:`PeerScroll` remembers where the table is. Both are
used in the app's thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from monitor.crowd import clamp_offset

# Escape sequences of xterm-like terminals (normal and application cursor mode).
_SEQUENCES = {
    "\x1b[A": "up",
    "\x1bOA": "up",
    "\x1b[B": "down",
    "\x1bOB": "down",
    "\x1b[5~": "page_up",
    "\x1b[6~": "page_down",
    "\x1b[H": "home",
    "\x1bOH": "home",
    "\x1b[1~": "home",
    "\x1b[7~": "home",
    "\x1b[F": "end",
    "\x1bOF": "end",
    "\x1b[4~": "end",
    "\x1b[8~": "end",
}
# Single keys, less's and vi's among them (terminals without arrows, muscle memory).
_SINGLE = {
    "q": "quit",
    "Q": "quit",
    "k": "up",
    "j": "down",
    "b": "page_up",
    " ": "page_down",
    "g": "home",
    "G": "end",
    "a": "toggle",
    "\x1b": "escape",
}


def parse_keys(data: str) -> list[str]:
    """The keys in ``data`` by name (``quit``, ``up``, ``down``, ``page_up``, ``page_down``,
    ``home``, ``end``, ``toggle``, ``escape``); other keys and unknown sequences are dropped."""
    names, index = [], 0
    while index < len(data):
        sequence = next((s for s in _SEQUENCES if data.startswith(s, index)), None)
        if sequence is not None:
            names.append(_SEQUENCES[sequence])
            index += len(sequence)
        elif data.startswith(("\x1b[", "\x1bO"), index):  # another key's sequence (F1, ...)
            index += 2
            while index < len(data) and not ("@" <= data[index] <= "~"):
                index += 1
            index += 1  # its final byte
        else:
            if data[index] in _SINGLE:
                names.append(_SINGLE[data[index]])
            index += 1
    return names


@dataclass
class PeerScroll:
    """Where the live view's whole peer table is scrolled to.

    Attributes:
        offset: the first row shown; None shows the overview instead of the table.
    """

    offset: int | None = None

    def press(self, key: str, *, num_peers: int, rows: int) -> bool:
        """Move for ``key`` on a table of ``num_peers`` with ``rows`` a page; True if it moved.

        A scrolling key on the overview opens the table at its top (End: at its bottom).
        """
        before = self.offset
        if key in ("toggle", "escape"):
            self.offset = 0 if key == "toggle" and self.offset is None else None
            return self.offset != before
        if key not in ("up", "down", "page_up", "page_down", "home", "end"):
            return False
        if self.offset is None:
            self.offset = clamp_offset(num_peers, num_peers, rows) if key == "end" else 0
            return True
        step = {"up": -1, "down": 1, "page_up": -rows, "page_down": rows}
        if key == "home":
            offset = 0
        elif key == "end":
            offset = num_peers
        else:
            offset = self.offset + step[key]
        self.offset = clamp_offset(offset, num_peers, rows)
        return self.offset != before

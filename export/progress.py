"""Progress of long work on stderr: a tqdm bar per stage on a terminal, plain lines elsewhere.

    with Stage("quantizing weights (scale search)", total=n, unit="tensor") as bar:
        for ...:
            bar.update()

On a terminal each stage draws a tqdm bar (shown once the stage has run ``delay_s``). When
stderr is a file or a pipe (a log, CI, ``2>&1 | tee``) a stage writes one line once it has run
``delay_s``, another every ``every_s`` and a last one when it ends, so long work is never silent
and short work (or work that fails at once) writes nothing. ``enabled=False`` writes nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


DELAY_S = 1.0  # a stage shorter than this writes nothing
EVERY_S = 10.0  # plain lines: one per this many seconds


class Stage:
    def __init__(self, desc: str, total: int | None = None, unit: str = "it", enabled: bool = True,
                 delay_s: float | None = None, every_s: float | None = None, stream: TextIO | None = None,
                 unit_scale: bool = False) -> None:
        self.desc, self.total, self.unit, self.unit_scale = desc, total, unit, unit_scale
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self.every_s = EVERY_S if every_s is None else every_s
        self.n = 0
        self.note = ""  # what the stage is doing now (shown after the bar, or at the end of a plain line)
        self.start = time.monotonic()
        self._last_line: float | None = None  # when the last plain line was written (None: none yet)
        self._bar: Any = None
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=self.stream,
                             delay=self.delay_s, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            now = time.monotonic()
            due = self.start + self.delay_s if self._last_line is None else self._last_line + self.every_s
            if now >= due:
                self._line(now)

    def set_note(self, note: str) -> None:
        """Say what the stage is doing now (a long step without a count: the bar's postfix, or the next plain line)."""
        self.note = note
        if self._bar is not None:
            self._bar.set_postfix_str(note[:48], refresh=True)

    def tick(self) -> None:
        """Time passed without a step: the bar redraws its clock; plain, a line when one is due."""
        if self._bar is not None:
            self._bar.refresh()
        else:
            self.update(0)

    def _count(self) -> str:
        n = _scaled(self.n) if self.unit_scale else str(self.n)
        total = "" if self.total is None else "/" + (_scaled(self.total) if self.unit_scale else str(self.total))
        return f"{n}{total} {self.unit}"

    def _line(self, now: float, done: bool = False) -> None:
        state = "done" if done else "…"
        count = f"{self._count()}, " if self.total is not None or self.n else ""
        note = f" ({self.note})" if self.note and not done else ""
        print(f"decodert: {self.desc}: {count}{now - self.start:.1f} s {state}{note}", file=self.stream, flush=True)
        self._last_line = now

    def close(self, failed: bool = False) -> None:
        """End the stage: the bar is closed; a plain stage that wrote lines (or ran long) writes its last one."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and not failed:
            now = time.monotonic()
            if self._last_line is not None or now - self.start >= self.delay_s:
                self._line(now, done=True)
        self.enabled = False

    def __enter__(self) -> "Stage":
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        self.close(failed=kind is not None)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _scaled(n: float) -> str:
    """1234567 -> '1.2M' (tqdm's unit_scale style, for the plain lines)."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.1f}{suffix}"
    return str(int(n))

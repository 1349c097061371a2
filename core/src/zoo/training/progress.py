"""The progress display of a run: a bar on a terminal, a line per logging interval otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line bar on a terminal, a plain line per logging interval otherwise."""

    def __init__(self, total: int, *, enabled: bool, start: int = 0) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.start = start

    def update(self, step: int, fields: dict[str, str], *, log_line: bool) -> None:
        if not self.enabled:
            return
        done = step / max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.tty:
            bar = "#" * int(done * 20)
            sys.stderr.write(f"\r[{bar:<20}] {step}/{self.total} {text} eta {eta:.0f}s\x1b[K")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif log_line:
            print(f"step {step}/{self.total} {text}", flush=True)

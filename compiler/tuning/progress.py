"""Tuning progress: a live bar on a terminal, a plain line per measured round otherwise."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

BAR = 24


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Trials done of ``total``, the best latency so far with its GFLOP/s, elapsed and remaining time."""

    def __init__(self, total: int, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.total, self.done = total, 0
        self.best: str = "no measurement yet"
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.live:  # keep the clock moving while a round is being built and measured
            threading.Thread(target=self._tick, daemon=True).start()

    def advance(self, trials: int, best_us: float | None, gflops: float | None, label: str = "") -> None:
        with self._lock:
            self.done += trials
            if best_us is not None:
                rate = f" ({gflops:.1f} GFLOP/s)" if gflops else ""
                self.best = f"best {best_us:,.1f} µs{rate}" + (f" {label}" if label else "")
            if self.live:
                self._draw()
            else:
                print(f"tune: {self._status()}", file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self.live:
            with self._lock:
                self._draw()
                self.stream.write("\n")
                self.stream.flush()

    def _status(self) -> str:
        elapsed = time.monotonic() - self.start
        left = f"~{clock(elapsed / self.done * (self.total - self.done))} left" if self.done else "estimating"
        return f"{self.done}/{self.total} trials, {self.best}, {clock(elapsed)} elapsed, {left}"

    def _draw(self) -> None:
        filled = BAR * self.done // max(self.total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (BAR - filled)}] {self._status()}\x1b[K")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._draw()

"""Progress of a long host loop (scoring, evaluation): a tqdm bar on a terminal; where stderr is not one (a log file,
a CI job, a pipe) a bar's carriage returns would pile up unseen, so instead one plain line every few seconds."""

from __future__ import annotations

import sys
import time


class Progress:
    """Counts `total` items of `unit` under `desc`. enabled None: on (a bar on a terminal, else lines), False: silent,
    True: on. every: seconds between lines when not on a terminal. Use as a context manager, or close()."""

    def __init__(self, total: int, desc: str, unit: str = "it", *, enabled: bool | None = None, file=None,
                 every: float = 5.0):
        self.total, self.desc, self.unit, self.every = int(total), desc, unit, float(every)
        self.file = sys.stderr if file is None else file
        self.done = 0
        self._bar = None
        self._on = enabled is not False
        self._t0 = self._last = time.monotonic()
        if self._on and _is_terminal(self.file):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.file, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._on and time.monotonic() - self._last >= self.every:
            self._line()

    def _line(self) -> None:
        self._last = now = time.monotonic()
        elapsed = now - self._t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        print(f"{self.desc}: {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
              f"{elapsed:.0f} s, {rate:.2f} {self.unit}/s, ~{left:.0f} s left", file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False

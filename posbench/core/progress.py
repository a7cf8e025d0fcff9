"""Progress of training and evaluation: a tqdm bar on a terminal; off one (a log file, SLURM,
joblib), one plain line per `log` call, since tqdm there writes a carriage-return frame per
refresh."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import List, Optional

from tqdm import tqdm


_during: List[str] = []  # what the bars opened now belong to (`during`)


@contextmanager
def during(where: str):
    """Bars opened inside name `where` after their own desc (`eval at step 4/20: ...`), so that
    an evaluation in the middle of training says which step it scores."""
    _during.append(where)
    try:
        yield
    finally:
        _during.pop()


class Bar:
    """Counts `total` units from `initial`: `update()` after each, `log(...)` where a line is due
    (called after at least one update)."""

    def __init__(self, desc: str, total: Optional[int], unit: str, initial: int = 0,
                 enabled: bool = True):
        desc = f"{desc} at {_during[-1]}" if _during else desc
        self.desc, self.total, self.unit, self.initial = desc, total, unit, initial
        self.n, self.enabled = initial, enabled
        self.stream = sys.stderr  # tqdm's stream
        self.started = time.perf_counter()
        self.tqdm = (tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                          disable=not enabled) if self.stream.isatty() else None)

    def update(self) -> None:
        self.n += 1
        if self.tqdm is not None:
            self.tqdm.update()

    def log(self, where: Optional[str] = None, **fields) -> None:
        """tqdm: the fields as its postfix. Plain: `desc: where k=v ... elapsed=.. eta=..`, where
        defaults to `unit n/total`."""
        if self.tqdm is not None:
            self.tqdm.set_postfix(fields)
            return
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        parts = [where or f"{self.unit} {self.n}" + (f"/{self.total}" if self.total else ""),
                 *(f"{key}={value}" for key, value in fields.items()),
                 f"elapsed={tqdm.format_interval(elapsed)}"]
        if self.total:  # None: units until a clock runs out (train.budget=wallclock)
            # the rate of this session's units: a resumed run's earlier steps took no time here
            eta = elapsed / (self.n - self.initial) * (self.total - self.n)
            parts.append(f"eta={tqdm.format_interval(eta)}")
        print(f"{self.desc}: " + " ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()

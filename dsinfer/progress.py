"""Progress of long operations (loading, compiling, verifying, probing, benchmarks).

On a terminal (stderr is a TTY): a rich progress bar that disappears when done. Otherwise —
logs, CI, pipes — plain log lines at each quarter, never a control character.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

logger = logging.getLogger("dsinfer.progress")


@contextlib.contextmanager
def progress(description: str, total: float, log: bool = True) -> Iterator[Callable[[float], None]]:
    """Yields advance(amount); `total` is what the amounts add up to (tensors, bytes, steps).
    `log=False`: nothing at all off a terminal (a bar the caller asked for, not a log)."""
    if total <= 0 or (not log and not sys.stderr.isatty()):
        yield lambda _amount=1: None
        return
    if sys.stderr.isatty():
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda amount=1: bar.advance(task, amount)
        return
    done, next_mark = [0.0], [0.25]

    def advance(amount: float = 1) -> None:
        done[0] += amount
        while next_mark[0] <= 1.0 and done[0] >= next_mark[0] * total:
            logger.info("%s: %d%%", description, round(100 * next_mark[0]))
            next_mark[0] += 0.25

    yield advance

"""What a long ``kvroute bench`` run shows while it works, and where its results are at the end.

    Bar              one loop's progress: a replay's requests (with an errors count), or
                     phases (policies, sizes, rates, systems) with the current one named
    track()          a loop's items under a Bar
    Outputs          the files under a run's ``--output`` before it started; ``written()``:
                     those it created or changed since
    report_outputs() the closing list: result files (JSON, PNG, HTML, Markdown, ...) with
                     their sizes, other files (logs) counted per folder
    closing_report() both around a whole run: ``Command`` wraps every sub-command in it

On a terminal a Bar is a rich progress bar, redrawn in place. Where the output is not a
terminal (a log file, CI), or under ``--no-progress``, it prints a plain line instead at
each phase and every tenth of a replay's requests, so a log stays readable: no carriage
returns, no cursor codes.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")

# Files a run writes for people to read; anything else (logs, raw dumps) is counted, not listed.
RESULT_SUFFIXES = frozenset({".json", ".jsonl", ".png", ".svg", ".html", ".md", ".csv", ".txt"})
PLAIN_LINES_PER_BAR = 10  # a replay without a terminal prints a line every tenth of its requests

# Whether bars may draw in place; ``closing_report(live=False)`` (``--no-progress``) turns it off
# for one run. Written only by ``live_bars``.
_live_bars: ContextVar[bool] = ContextVar("kvroute_bench_live_bars", default=True)


@contextmanager
def live_bars(enabled: bool) -> Iterator[None]:
    """Bars drawn in place (where the console is a terminal) or plain lines, within this block."""
    token = _live_bars.set(enabled)
    try:
        yield
    finally:
        _live_bars.reset(token)


# The display drawn in place now, if any: a bar opened within another's block adds a row to it.
# Written only by ``Bar.__enter__`` and ``Bar.__exit__`` of the bar that started it.
_shown_progress: ContextVar[Progress | None] = ContextVar("kvroute_bench_progress", default=None)


def _columns() -> tuple:
    """A display's columns; new ones per display, as columns cache what they drew per task id."""
    return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[errors]}"))


def draws_in_place(console: Console) -> bool:
    return _live_bars.get() and console.is_terminal and not console.is_dumb_terminal


def elapsed(seconds: float) -> str:
    """``0:01:05``, as rich's elapsed column shows it."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class Bar:
    """Counts the finished units of one loop; a context manager.

    Two ways to count. ``advance()`` per finished unit (a request; ``errors=True`` adds an
    errors count, ``advance(failed=True)``): without a terminal a line every tenth of
    ``total`` and at the last. Or ``step(name)`` as each named phase starts (a policy, a
    size): it ends the phase before, and leaving the block without an error ends the last;
    on a terminal the name shows beside the bar, otherwise each phase prints a line.

    Bars opened inside another's block (a replay's requests within its policy) are rows of
    the outer one's display, removed when their block ends.

    ``redraw=False`` for loops that time something in this process: no thread redraws the
    display in the background (it would take the GIL and a core mid-sample); it is drawn
    only when a bar changes, between samples."""

    def __init__(self, console: Console, description: str, total: int | None, unit: str = "",
                 errors: bool = False, redraw: bool = True):
        self.console, self.description, self.total, self.unit = console, description, total, unit
        self.redraw = redraw
        self.errors: int | None = 0 if errors else None
        self.done, self.steps = 0, 0
        self._in_step = False
        self._started = time.monotonic()
        self._progress: Progress | None = None
        self._owns_progress = False
        self._task = None

    def __enter__(self) -> Bar:
        if draws_in_place(self.console):
            self._progress = _shown_progress.get()
            if self._progress is None:
                self._progress = Progress(*_columns(), console=self.console, auto_refresh=self.redraw)
                self._owns_progress = True
                self._progress.start()
                _shown_progress.set(self._progress)
            self._task = self._progress.add_task(self.description, total=self.total, unit=self.unit,
                                                 errors=self._errors_text())
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self._in_step and error_type is None:
            self.advance()
        if self._owns_progress:
            # Not a token's reset: a generator's bar (``track``) may be closed from another context.
            _shown_progress.set(None)
            self._progress.stop()
        elif self._progress is not None:
            self._progress.remove_task(self._task)
        elif self.steps and self.done == self.total:
            self._say(f"{self.description}: {self._count()} done in {elapsed(self._seconds())}")

    def step(self, name: str) -> None:
        if self._in_step:
            self.advance()
        self._in_step = True
        self.steps += 1
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.description}: {name}", refresh=True)
        else:
            self._say(f"[{self.done + 1}/{self._total_text()}] {self.description}: {name} "
                      f"({elapsed(self._seconds())})")

    def advance(self, failed: bool = False) -> None:
        self.done += 1
        if self.errors is not None:
            self.errors += failed
        if self._progress is not None:
            self._progress.update(self._task, advance=1, errors=self._errors_text(), refresh=True)
        elif not self.steps and self._plain_line_due():
            self._say(f"{self.description}: {self._count()}{self._errors_text(', ')} ({elapsed(self._seconds())})")

    def _errors_text(self, before: str = "") -> str:
        if self.errors is None:
            return ""
        return f"{before}{self.errors} error{'' if self.errors == 1 else 's'}"

    def _total_text(self) -> str:
        return "?" if self.total is None else str(self.total)

    def _plain_line_due(self) -> bool:
        if self.total is None:
            return self.done % 25 == 0
        every = max(1, self.total // PLAIN_LINES_PER_BAR)
        return self.done % every == 0 or self.done == self.total

    def _count(self) -> str:
        return f"{self.done}/{self._total_text()}" + (f" {self.unit}" if self.unit else "")

    def _seconds(self) -> float:
        return time.monotonic() - self._started

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def request_bar(console: Console, description: str, total: int) -> Bar:
    """A replay's finished requests and its errors: ``advance(failed=not row.succeeded)``."""
    return Bar(console, description, total, unit="requests", errors=True)


def track(items: Iterable[T], description: str, console: Console, name: Callable[[T], str] = str,
          redraw: bool = True) -> Iterator[T]:
    """Each of ``items`` in turn under a Bar that names it (``name(item)``) as it starts."""
    items = list(items)
    with Bar(console, description, len(items), redraw=redraw) as bar:
        for item in items:
            bar.step(name(item))
            yield item


# ---------------------------------------------------------------- where the results are


@dataclass(frozen=True)
class Outputs:
    """The files under ``root`` (a folder, or one file) as they were when the run started."""

    root: Path
    before: dict[Path, tuple[int, int]]  # path -> (mtime in ns, size)

    @classmethod
    def watch(cls, root: str | Path) -> Outputs:
        return cls(Path(root), _files(Path(root)))

    def written(self) -> list[Path]:
        """Files created or changed since ``watch``, sorted."""
        return sorted(path for path, state in _files(self.root).items() if self.before.get(path) != state)


def _files(root: Path) -> dict[Path, tuple[int, int]]:
    """Every regular file under ``root`` (or ``root`` itself, a file) with its mtime and size."""
    if root.is_file():
        paths = [root]
    else:
        paths = [Path(folder, name) for folder, _, names in os.walk(root) for name in names]
    found = {}
    for path in paths:
        try:
            stat = path.stat()
        except OSError:  # removed meanwhile, or a dangling link
            continue
        found[path] = (stat.st_mtime_ns, stat.st_size)
    return found


def human_size(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def shown(path: Path) -> str:
    """The path as a user would type it here: relative to the working folder where it lies within."""
    absolute = path.absolute()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def report_outputs(paths: Iterable[Path], console: Console) -> None:
    """The closing list: every result file with its size; other files (logs) counted per folder."""
    paths = sorted(paths)
    if not paths:
        console.print("This run wrote no files.", highlight=False)
        return
    sizes = {path: _size(path) for path in paths}
    results = [path for path in paths if path.suffix.lower() in RESULT_SUFFIXES]
    others: dict[Path, list[Path]] = defaultdict(list)
    for path in paths:
        if path not in results:
            others[path.parent].append(path)
    console.print("Results of this run:", highlight=False)
    for path in results:
        _line(console, human_size(sizes[path]), shown(path))
    for folder, files in others.items():
        if len(files) == 1:
            _line(console, human_size(sizes[files[0]]), shown(files[0]))
        else:
            kinds = ", ".join(sorted({path.suffix or "no suffix" for path in files}))
            _line(console, human_size(sum(sizes[path] for path in files)),
                  f"{shown(folder)}{os.sep} ({len(files)} files: {kinds})")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _line(console: Console, size: str, what: str) -> None:
    console.print(f"  {size:>10}  {what}", highlight=False, markup=False, soft_wrap=True)


@contextmanager
def closing_report(output: str | Path | None, live: bool = True, console: Console | None = None) -> Iterator[None]:
    """Run the block with bars drawn in place or not (``live``); then list what it wrote under
    ``output``. Also when the block fails, where it wrote something: partial results."""
    watch = Outputs.watch(output) if output is not None else None
    finished = False
    try:
        with live_bars(live):
            yield
        finished = True
    finally:
        if watch is not None:
            written = watch.written()
            if finished or written:
                report_outputs(written, console or Console())

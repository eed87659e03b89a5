"""Progress while pulling a packaged model: a rich display on stderr, and the scoped patches that
route transformers' own progress bars (including its GGUF dequantizer's raw tqdm) into it or silence them.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import TaskID

logger = logging.getLogger(__name__)

__all__ = ["Progress", "dequantize_progress", "quiet_transformers"]


class Progress:
    """A rich progress display on stderr (a no-op when disabled). Tasks with no total show a spinner.

    Use it as a context manager; `add` starts a task and returns its id, `advance` moves it by an
    amount (in the task's own unit: bytes, files, packages), `done` completes it and logs (at
    DEBUG) how long it took in seconds.
    """

    def __init__(self, enabled: bool, title: str):
        from rich.console import Console
        from rich.progress import BarColumn, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.enabled = enabled
        self.title = title
        self._started: dict[TaskID, float] = {}
        self._progress = RichProgress(
            SpinnerColumn(),
            TextColumn(f"[bold]{title}[/bold] {{task.description}}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),  # bound now: quiet_transformers swaps sys.stderr
            disable=not enabled,
        )

    def __enter__(self) -> Progress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def add(self, description: str, total: float | None = None) -> TaskID:
        """Start a task; ``total`` in the task's unit, None for a spinner. Returns the task id."""
        task = self._progress.add_task(description, total=total)
        self._started[task] = time.monotonic()
        return task

    def advance(self, task: TaskID, amount: float) -> None:
        """Move ``task`` forward by ``amount`` (its unit)."""
        self._progress.advance(task, amount)

    def done(self, task: TaskID) -> None:
        """Mark ``task`` complete (a spinner task becomes a full bar)."""
        t = next(t for t in self._progress.tasks if t.id == task)
        total = t.total or 1
        self._progress.update(task, total=total, completed=total)
        logger.debug("eventkv: %s: %s took %.1f s", self.title, t.description, time.monotonic() - self._started[task])


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars inside the block, including the raw tqdm bar of its
    GGUF dequantizer, by pointing ``sys.stderr`` at a buffer (rich and logging keep their streams).
    Both are restored when the block exits, also on an exception."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def dequantize_progress(ui: Progress) -> Iterator[None]:
    """Report transformers' GGUF dequantization loop (a tqdm over the file's tensors) as a rich task.

    Swaps the ``tqdm`` name of ``transformers.modeling_gguf_pytorch_utils`` for the duration of
    the block and restores it in ``finally``; if that module or name moved, the step just shows
    no bar.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def tracked(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        task = ui.add("dequantizing GGUF tensors", total=len(items))
        for item in items:
            yield item
            ui.advance(task, 1)
        ui.done(task)

    gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        gguf_utils.tqdm = original

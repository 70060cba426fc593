"""SIGTERM / SIGINT: finish the current step, checkpoint, exit 0 (schedulers send SIGTERM before a kill)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

from llm.train.distributed import all_ranks_agree

__all__ = ["StopRequest"]


class StopRequest:
    """Installs handlers that only set a flag; the training loop polls ``requested()`` between steps.

    A second SIGINT raises ``KeyboardInterrupt`` as usual, so an impatient Ctrl-C still stops at once.
    Handlers can only be installed from the main thread; elsewhere (e.g. a test thread) the object
    just never fires. ``restore()`` puts the previous handlers back.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self) -> bool:
        """Whether any rank received a signal: ranks must agree, or one would wait in a collective
        for a step the others never take."""
        return all_ranks_agree(self.signum is not None, any_rank=True)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

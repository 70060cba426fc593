"""SIGTERM / SIGINT: finish the current step, checkpoint, exit 0 (schedulers send SIGTERM before a kill)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["StopRequest"]


class StopRequest:
    """Installs handlers that only set a flag; ``train_step`` polls ``received`` and agrees on it over ranks
    (any rank's signal stops every rank after that same step: otherwise one rank would wait in a
    collective for a step the others never take).

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

    def received(self) -> bool:
        """Whether this process received a signal (other ranks may not have)."""
        return self.signum is not None

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

"""SIGTERM / SIGINT: finish the current step, checkpoint, exit 0 (schedulers send SIGTERM before a kill); a rank
that cannot (blocked in a collective whose peer is gone) exits 1 after a grace time instead of hanging."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

from llm.errors import stderr_line

__all__ = ["StopRequest"]


class StopRequest:
    """Installs handlers that only set a flag; ``train_step`` polls ``received`` and agrees on it over ranks
    (any rank's signal stops every rank after that same step: otherwise one rank would wait in a
    collective for a step the others never take).

    A second SIGINT raises ``KeyboardInterrupt`` as usual, so an impatient Ctrl-C still stops at once.
    Handlers can only be installed from the main thread; elsewhere (e.g. a test thread) the object
    just never fires. ``restore()`` puts the previous handlers back.

    A Python handler runs only between bytecodes of the main thread, never while it waits inside a collective.
    So the signal also reaches a watchdog thread through ``signal.set_wakeup_fd`` (written by the C-level handler
    at once): if the process is still running ``grace_s`` seconds later, it prints one line and exits 1
    (``os._exit``: the main thread cannot be interrupted; checkpoints are written atomically, so none is torn).
    That line starts a line of its own while ``bar_drawn()`` (a progress bar, which ends no line, is on the screen).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float | None = None, bar_drawn: Callable[[], bool] = lambda: False) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._ended = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            if grace_s is not None:
                self._start_watchdog(grace_s, bar_drawn)

    def _start_watchdog(self, grace_s: float, bar_drawn: Callable[[], bool]) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._wakeup = reader, writer
        self._previous_fd = signal.set_wakeup_fd(writer.fileno())

        def watch() -> None:
            while True:  # the wakeup fd carries every signal with a Python handler (SIGCHLD of data workers too)
                try:
                    data = reader.recv(1)
                except OSError:
                    return
                if not data:  # restore(): the run ended
                    return
                if data[0] in self.SIGNALS:
                    break
            if self._ended.wait(grace_s):
                return
            start = "\n" if bar_drawn() else ""  # a bar's line ends in its last refresh, with no newline
            stderr_line(f"{start}error: still running {grace_s:g} s after signal {data[0]} (train.stop_grace_s): "
                        "blocked in a collective whose peer stopped or is stuck; exiting. Checkpoints written before "
                        "are intact.")
            os._exit(1)

        threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()

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
        self._ended.set()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            reader, writer = self._wakeup
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv
            reader.close()
            writer.close()
            self._wakeup = None

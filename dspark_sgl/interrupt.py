"""Ctrl-C that works within a second, even while the main thread sits in a long native call.

Python runs a SIGINT handler only between bytecodes of the main thread, so a KeyboardInterrupt can wait for the
end of a long matmul, a GGUF conversion or a safetensors read. Here SIGINT is blocked in every thread and taken
by one waiter thread with `sigtimedwait`: it raises KeyboardInterrupt in the main thread at once and, if the main
thread has not finished unwinding `grace_s` later, exits the process with status 130. Files are written whole
and renamed (`save_draft`), so an interrupted command leaves no partial output that looks complete.
Only for commands that run no child processes: a child would inherit the blocked signal.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def prompt_interrupt(grace_s: float = 1.0) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "sigtimedwait"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    finished = threading.Event()

    def wait_for_ctrl_c() -> None:
        while not finished.is_set():
            if signal.sigtimedwait({signal.SIGINT}, 0.1) is None:
                continue
            _thread.interrupt_main()
            if not finished.wait(grace_s):
                _exit_interrupted()
            return

    waiter = threading.Thread(target=wait_for_ctrl_c, name="dspark-sigint", daemon=True)
    waiter.start()
    try:
        yield
    except KeyboardInterrupt:  # leave now: interpreter shutdown with torch loaded can take seconds
        finished.set()
        _exit_interrupted()
    finally:
        finished.set()
        waiter.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _exit_interrupted() -> None:
    sys.stdout.flush()
    sys.stderr.write("\ninterrupted\n")
    sys.stderr.flush()
    os._exit(130)

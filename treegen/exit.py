"""How a treegen process ends: sys.exit, except in a torchrun worker that joined a process group.

Such a worker has left its group by its last line (train/distributed.py's leave()), but the interpreter's
teardown that follows can still abort it in gloo's threads (exit -6 after a finished run), and torchrun then
fails the whole run. So it ends with os._exit once its output is flushed: every file it wrote is closed by then.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

_worker = False


def as_worker() -> None:
    """This process joined a torchrun process group: end it without the interpreter's teardown."""
    global _worker
    _worker = True


def end(code: int | None) -> NoReturn:
    code = code if isinstance(code, int) else 0
    if not _worker:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed or broken stream: nothing more to write there
            pass
    os._exit(code)

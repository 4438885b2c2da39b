"""llama.cpp's own output during an export, in a log file beside it: the console carries the stage's lines only.

llama.cpp reports as it works: its model loader dumps every metadata key of each GGUF it opens, its quantizer
writes a line per tensor, a vocab-only load warns about its context, and its converter logs each tensor it
writes. llama-cpp-python's ``verbose=False`` does not silence it: ``llama_model_quantize`` has no such flag, and
the binding's own log callback maps ggml's levels off by one (its table predates ``GGML_LOG_LEVEL_DEBUG = 1``,
so an INFO line passes as a warning and a warning as an error). A person reads the run's own lines; someone
debugging a failed conversion needs llama.cpp's. So, while ``llama_cpp_log(path)`` is open (one per export: the
export stage's ``models/export/llama_cpp.log``, promote's parity check's ``models/promote_parity.llama_cpp.log``):

- llama.cpp's log (``llama_log_set``, llama's and ggml's alike), every level, is appended to path by this
  module's callback instead of llama-cpp-python's printing one; its warnings and errors are counted;
- ``native_output()`` points file descriptors 1 and 2 at path around one call into llama.cpp's C code (the
  quantizer, a model load), for what that code writes to them directly (ggml's row validation, for one);
- the converter's subprocess writes its stdout and stderr to path (``LlamaCppLog.fd``);

and a failure names what failed, with llama.cpp's last lines and the log's path (``failure``). The descriptors are
process-wide, so they are redirected around single calls only, one at a time, and restored in ``finally``; the
stage runs in a process of its own. With no log open every call behaves as llama-cpp-python makes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from fineflow.export.tooling import require_llama_cpp

LOG_FILE = "llama_cpp.log"  # in the export's folder: models/export/llama_cpp.log
# ggml.h's enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4
TAIL_LINES = 3  # of llama.cpp's output, in a failure's message

_redirect = threading.Lock()  # one descriptor redirection at a time
_current: LlamaCppLog | None = None
_callback = None  # the ctypes callback given to llama_log_set, kept alive while llama.cpp may call it


class LlamaCppLog:
    """An open llama.cpp log: path (emptied when opened), appended to through one descriptor (``fd``), and how many
    warnings and errors llama.cpp logged into it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.warnings = 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def since(self, offset: int) -> str:
        """What was written from offset on."""
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")


def current() -> LlamaCppLog | None:
    """The open llama.cpp log, if any."""
    return _current


def mark() -> int:
    """Where the open log ends now (0 with none open): where one call's output starts."""
    return _current.size() if _current is not None else 0


def output_since(start: int) -> str:
    """What llama.cpp wrote into the open log from start on ("" with none open)."""
    return _current.since(start) if _current is not None else ""


def where() -> str:
    """The end of a failure's message that names the open log ("" with none open)."""
    return f" (llama.cpp's output: {_current.path})" if _current is not None else ""


def failure(what: str, output: str) -> str:
    """One message: what failed, the last lines of llama.cpp's output for that call, and the log holding it all."""
    last = [line.strip() for line in output.splitlines() if line.strip()][-TAIL_LINES:]
    return what + (": " + " | ".join(last) if last else "") + where()


def _to_log(level: int, text: bytes | None, user_data) -> None:
    native = _current
    if native is None or not text:
        return
    if level in (GGML_LOG_WARN, GGML_LOG_ERROR):
        native.warnings += 1
    try:
        os.write(native.fd, text)
    except OSError:  # a full disk must not turn llama.cpp's report into a crash inside its callback
        pass


@contextlib.contextmanager
def llama_cpp_log(path: Path) -> Iterator[LlamaCppLog]:
    """llama.cpp's log into path while open (then llama-cpp-python's own callback again)."""
    global _current, _callback
    llama_cpp = require_llama_cpp()
    from llama_cpp._logger import llama_log_callback as bindings_callback

    if _callback is None:
        _callback = llama_cpp.llama_log_callback(_to_log)
    path.parent.mkdir(parents=True, exist_ok=True)
    native, previous = LlamaCppLog(path), _current
    _current = native
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
    try:
        yield native
    finally:
        _current = previous
        if previous is None:
            llama_cpp.llama_log_set(bindings_callback, ctypes.c_void_p(0))
        os.close(native.fd)


def _flush() -> None:
    """Python's and C's buffered output written out, so that it lands where it was meant to."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def native_output() -> Iterator[None]:
    """File descriptors 1 and 2 into the open llama.cpp log around one call into llama.cpp (left as they are with
    no log open)."""
    native = _current
    if native is None:
        yield
        return
    with _redirect:
        _flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(native.fd, 1)
            os.dup2(native.fd, 2)
            yield
        finally:
            _flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])

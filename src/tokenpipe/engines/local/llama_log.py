"""llama.cpp's own log goes to the `tokenpipe.llama` logger, not straight to the terminal.

llama.cpp reports model loading, the KV-cache layout and context-size notes
(`llama_kv_cache_iswa: using full-size SWA cache ...`, `n_ctx_seq (512) > n_ctx_train (0)`)
through one process-wide callback. llama-cpp-python's own callback maps ggml's log levels by an
older enum, so with `verbose=False` it still prints every warning to stderr. Ours logs llama.cpp's
errors as warnings and everything else at DEBUG: shown with `--log-level debug` only.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

_log = logging.getLogger("tokenpipe.llama")
#: ggml_log_level (ggml.h): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5.
_GGML_ERROR = 4
#: The installed ctypes callback: llama.cpp keeps a bare pointer to it, so it must stay alive.
_callback: Any = None


def route_to_logging() -> None:
    """Installs the callback (once per process) before any model or vocabulary is loaded."""
    global _callback
    if _callback is not None:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    def forward(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        # Called from llama.cpp's threads too; a log line costs one level check when quiet.
        at = logging.WARNING if level == _GGML_ERROR else logging.DEBUG
        if _log.isEnabledFor(at):
            line = text.decode(errors="replace").rstrip("\n")
            if line:
                _log.log(at, "%s", line)

    llama_cpp.llama_log_set(forward, ctypes.c_void_p(0))
    _callback = forward

"""`python benchmarks/_opcodes.py -m tokenpipe serve ...` (or `... bare_relay.py ...`): the
gateway (or the bare relay), counting the bytecode
instructions each of its functions executes between SIGUSR1 (start) and SIGUSR2 (stop: the
counts are written as JSON, {"file:qualified name": instructions}, to $TOKENPIPE_OPCODES_OUT, by
an atomic rename). Used by calls_per_request.py --opcodes.

sys.settrace with `f_trace_opcodes` calls a Python function per instruction, which slows the
gateway ~50x: the counts are exact, times are not, and work that runs by the clock rather
than per request (a quantile view refreshed every 0.25 s) is counted ~50x too often.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from collections import Counter
from types import CodeType, FrameType
from typing import Any

_counts: Counter[CodeType] = Counter()


def _local(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "opcode":
        _counts[frame.f_code] += 1
    return _local


def _call(frame: FrameType, event: str, arg: Any) -> Any:
    frame.f_trace_opcodes = True  # a coroutine's every resumption is a "call" too
    return _local


def _start(*_: object) -> None:
    _counts.clear()
    sys.settrace(_call)


def _stop(*_: object) -> None:
    sys.settrace(None)
    named: dict[str, int] = {}
    for code, n in _counts.items():
        key = f"{code.co_filename}:{code.co_qualname}"
        named[key] = named.get(key, 0) + n
    path = os.environ["TOKENPIPE_OPCODES_OUT"]
    with open(path + ".tmp", "w") as f:
        json.dump(named, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    args = sys.argv[1:]
    if args[:2] == ["-m", "tokenpipe"]:
        sys.argv = ["tokenpipe", *args[2:]]
        runpy.run_module("tokenpipe", run_name="__main__", alter_sys=True)
    elif args and args[0].endswith(".py"):  # a script: the bare relay
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    else:
        sys.exit("usage: _opcodes.py -m tokenpipe ARGS... | _opcodes.py SCRIPT.py ARGS...")

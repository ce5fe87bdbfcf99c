"""`tokenpipe serve` with no upstream: runs `tokenpipe local` as a managed child process.

A child process, not the model inside the gateway, because:
- the GIL: the decode thread runs Python between llama.cpp calls for every token, and in the
  gateway's process that work would compete with the event loop that relays every other stream;
  in its own process it has its own interpreter and the gateway keeps its latency;
- one code path: the gateway reaches the local model exactly as it reaches any upstream (HTTP,
  SSE, the same limiter, retries and metrics), which is also the path the tests and the
  benchmark measure;
- isolation: a crash or out-of-memory in native code takes down the child, not the gateway.
The child dies with the gateway (PR_SET_PDEATHSIG on Linux, SIGTERM on a normal exit).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from tokenpipe.observe.log_writer import write_all

_LISTEN = re.compile(rb"listening on (http://\S+)")
#: How long the child may take to load the model and listen (seconds).
START_TIMEOUT = 120.0


class ChildFailed(RuntimeError):
    pass


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the normal-exit SIGTERM below still applies
        pass


@contextlib.contextmanager
def local_engine(
    host: str = "127.0.0.1", port: int = 0, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """Starts `tokenpipe local`, yields its base URL (`http://HOST:PORT/v1`), stops it on exit.

    The child's log lines are forwarded to our stderr, prefixed; its "listening on" line is not,
    so whoever watches the gateway's output sees only the gateway's own listening line.
    """
    args = [
        sys.executable,
        "-m",
        "tokenpipe",
        "local",
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    assert proc.stdout is not None
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LISTEN.search(line) if not ready.is_set() else None
            if m:
                found.append(m.group(1).decode())
                ready.set()
                continue
            # By os.write, not sys.stderr: a stderr nobody reads stops this thread alone, not
            # whatever else writes to sys.stderr (its buffer's lock is not held meanwhile).
            write_all(2, b"[local] " + line)
        ready.set()  # EOF: the child exited

    pumper = threading.Thread(target=pump, name="tokenpipe-local-log", daemon=True)
    pumper.start()
    try:
        if not ready.wait(START_TIMEOUT) or not found:
            raise ChildFailed(f"tokenpipe local did not start (exit code {proc.poll()})")
        yield found[0] + "/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pumper.join(2)


def examples(base_url: str) -> str:
    """Copy-paste first requests against the gateway at `base_url` (`http://HOST:PORT/v1`)."""
    # A small max_tokens: the pretrained model seldom ends a turn by itself, so a first
    # request ends in a few seconds rather than at the engine's cap.
    body = (
        '{"model":"gemma-3-270m","stream":true,"max_tokens":64,'
        '"messages":[{"role":"user","content":"Write a haiku about rivers."}]}'
    )
    return (
        f"Try it (gateway at {base_url}):\n"
        f"  curl -N {base_url}/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n"
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base_url}', "
        "api_key='unused'); print(c.chat.completions.create(model='gemma-3-270m', max_tokens=64, "
        "messages=[{'role': 'user', 'content': 'Write a haiku about rivers.'}])"
        '.choices[0].message.content)"\n'
    )

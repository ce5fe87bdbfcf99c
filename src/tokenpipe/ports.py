"""Start-up port checks: a busy port (or an address not of this machine, a port that needs
privileges) is one line and exit code 2, never a traceback.

Every server command binds its HTTP socket (or checks its other ports) before any slow start-up
work, so `tokenpipe serve` on a busy port fails in a moment instead of after loading a model.
The bind itself, later, can still lose a race with another process: `startup_errors` turns that
failure into the same one line.
"""

from __future__ import annotations

import contextlib
import errno
import re
import socket
from collections.abc import Iterator

#: grpcio's message when `add_insecure_port` cannot bind (it raises RuntimeError, no errno).
_GRPC_BIND = re.compile(r"Failed to bind to address \S*?:(\d+)")


class CannotListen(Exception):
    """An address or port this process cannot listen on: the command says so in one line."""


class PortBusy(CannotListen):
    def __init__(self, port: int, flag: str) -> None:
        super().__init__(f"port {port} is in use (another tokenpipe?); use {flag}")
        self.port = port
        self.flag = flag


def _unknown_host(host: str, e: socket.gaierror) -> CannotListen:
    return CannotListen(f"cannot listen on {host!r}: {e.strerror}; use --host with an address")


def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise _unknown_host(host, e) from None
    family, _, _, _, addr = infos[0]
    return family, (str(addr[0]), int(addr[1]))


def _refused(e: OSError, host: str, port: int, flag: str) -> CannotListen | None:
    """What a failed bind means to the one who started the command (None: not theirs)."""
    if e.errno == errno.EADDRINUSE:
        return PortBusy(port, flag)
    if e.errno == errno.EADDRNOTAVAIL:
        return CannotListen(f"{host} is not an address of this machine; use --host")
    if e.errno == errno.EACCES:
        return CannotListen(f"port {port} needs privileges this process lacks; use {flag}")
    return None


def _bind(host: str, port: int, flag: str) -> socket.socket:
    family, addr = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As aiohttp's TCPSite and grpcio do: a port left in TIME_WAIT is free, one that another
        # socket is bound to is not. No SO_REUSEPORT: that would let us share a live port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        refused = _refused(e, host, port, flag)
        if refused is None:
            raise
        raise refused from None
    return sock


def bound_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to host:port (port 0: any free one), never listening: it holds the
    port while slow start-up work runs, and meanwhile connections are refused, not queued.
    The caller closes it just before its server binds the port itself."""
    return _bind(host, port, flag)


def check_free(host: str, port: int, flag: str) -> None:
    """Raises PortBusy when host:port is taken; for ports bound later by a library that cannot
    take a socket (grpcio). Port 0 is always free."""
    if port:
        _bind(host, port, flag).close()


@contextlib.contextmanager
def startup_errors(http_port: int, grpc_port: int = 0, host: str = "") -> Iterator[None]:
    """Turns a bind failure while a server starts into CannotListen (PortBusy: a race lost
    after the checks)."""
    try:
        yield
    except socket.gaierror as e:
        raise _unknown_host(host, e) from None
    except OSError as e:
        refused = _refused(e, host, http_port, "--port")
        if refused is None:
            raise
        raise refused from None
    except RuntimeError as e:
        m = _GRPC_BIND.search(str(e))
        if m is None:
            raise
        port = int(m.group(1))
        raise PortBusy(port, "--grpc-port" if port == grpc_port else "--port") from None

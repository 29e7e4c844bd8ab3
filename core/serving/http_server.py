"""uvicorn on a socket the caller bound, in its own thread, stopped when the caller says.

The caller binds the socket first (a port in use is an error at the entrance, before any agent
starts) and keeps the signals: uvicorn's own handlers re-raise the signal after shutting down,
which would end ``edgeshard serve`` with 130 instead of 0 after a clean stop (a loop in another
thread installs none). uvicorn runs on uvloop with httptools' parser (its ``[standard]`` speed-ups):
with asyncio's loop and h11 the server spent ~5% more CPU per streamed token (docs/serving.md, Measured).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time

from core.errors import FormatError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port); ``FormatError`` when it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise FormatError("--host", f"cannot resolve {host!r} ({err.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise FormatError("--port", f"cannot listen on {host}:{port} ({err.strerror or err})") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """An ASGI app served by uvicorn on ``sock`` from a background thread."""

    def __init__(self, app, sock: socket.socket, *, grace_s: float = 5.0) -> None:
        import uvicorn

        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace_s, timeout_keep_alive=5, loop="uvloop", http="httptools")
        self._server = uvicorn.Server(config)
        self._sock = sock
        self._loop_factory = config.get_loop_factory()
        self._thread = threading.Thread(target=self._serve, name="edgeshard-serve-http", daemon=True)

    def _serve(self) -> None:
        with asyncio.Runner(loop_factory=self._loop_factory) as runner:
            runner.run(self._server.serve(sockets=[self._sock]))

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop accepting, let in-flight responses finish for the grace time, then cancel them."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

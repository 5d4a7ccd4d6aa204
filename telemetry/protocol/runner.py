"""uvicorn on a socket of its own: in a daemon thread (the side endpoint inside vLLM, tests,
benchmarks) or in the foreground (`batchtop serve`).

`on_exit` runs when uvicorn is told to stop (a signal in the foreground, `stop()` in a thread),
before it waits for open connections: servers use it to end their endless event streams.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable

from .guard import check_bind


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app, *, on_exit: Callable[[int | None], None] | None = None, log_level: str = "warning",
                   access_log: bool = False):
    """A uvicorn.Server for `app`; `on_exit(signal number or None)` runs when it is told to stop."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if on_exit is not None:
                on_exit(sig)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=3,
                            timeout_keep_alive=30)
    return Server(config)


class ServerThread:
    """uvicorn in a daemon thread on `host:port` (0: a free port); the bind rule checked first."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None,
                 on_exit: Callable[[int | None], None] | None = None, name: str = "batchtop-http"):
        check_bind(host, api_key)
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        self._on_exit = on_exit
        self.uvicorn = uvicorn_server(app, on_exit=on_exit)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, name=name,
                                       daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._on_exit is not None:
            self._on_exit(None)
        self.uvicorn.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(app, host: str, port: int, *, api_key: str | None = None,
                  on_exit: Callable[[int | None], None] | None = None, access_log: bool = False) -> None:
    """Bind (after the loopback rule) and serve in this thread until a signal stops uvicorn."""
    check_bind(host, api_key)
    sock = bind_socket(host, port)
    try:
        uvicorn_server(app, on_exit=on_exit, access_log=access_log).run(sockets=[sock])
    finally:
        sock.close()

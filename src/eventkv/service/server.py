"""Start the service: token file, bind-address rule, uvicorn with connection timeouts."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eventkv.errors import EventKVError, OptionError
from eventkv.wire import check_name


def read_tokens(path: str | Path) -> dict[str, frozenset[str] | None]:
    """Bearer tokens from a token file: one per line, ``TOKEN`` (every namespace) or ``TOKEN NS[,NS...]``
    (only those namespaces); blank lines and lines starting with ``#`` are skipped.

    Raises:
        OptionError: the file is missing or unreadable, holds no token, a token shorter than 16
            characters, a repeated token, or a bad namespace (:func:`check_name`).
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(
            "token_file", str(p), f"give a readable UTF-8 token file ({exc}).", flag="--token-file"
        ) from None
    tokens: dict[str, frozenset[str] | None] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        token = parts[0]
        if len(token) < 16:
            raise OptionError(
                "token_file",
                f"{p}:{n}",
                "use tokens of at least 16 characters (e.g. `openssl rand -hex 32`).",
                flag="--token-file",
            )
        if token in tokens:
            raise OptionError(
                "token_file", f"{p}:{n}", "this token is repeated: give each token once.", flag="--token-file"
            )
        if len(parts) > 2:
            raise OptionError(
                "token_file",
                f"{p}:{n}",
                "write 'TOKEN' or 'TOKEN ns1,ns2' (no spaces between namespaces).",
                flag="--token-file",
            )
        tokens[token] = frozenset(check_name(x, "namespace") for x in parts[1].split(",")) if len(parts) == 2 else None
    if not tokens:
        raise OptionError("token_file", str(p), "the file holds no token: add one per line.", flag="--token-file")
    return tokens


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) binds only the loopback interface."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, tokens: dict) -> None:
    """Refuse a non-loopback bind without tokens.

    Raises:
        OptionError: ``host`` is not loopback and no token file was given.
    """
    if not tokens and not is_loopback(host):
        raise OptionError(
            "host",
            host,
            "a server reachable from other machines needs a token: give --token-file, or bind 127.0.0.1.",
            flag="--host",
        )


def check_port(host: str, port: int) -> None:
    """Refuse a port another process holds, before the model loads (``port`` 0: any free port).

    Raises:
        OptionError: the address cannot be bound (in use, or not an address of this machine).
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OptionError(
                "port",
                port,
                f"cannot bind {host}:{port} ({exc.strerror}): pick a free port, or --port 0.",
                flag="--port",
            ) from None


@dataclass(frozen=True)
class Connections:
    """How long a connection may take, and how many may be open (uvicorn's knobs, and one it lacks).

    Attributes:
        header_timeout: seconds from a connection's opening (or its previous answer) until the
            request's headers are complete; beyond, the connection is closed without an answer.
        keep_alive: seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``).
        limit_concurrency: open connections plus running requests at most; beyond, uvicorn answers
            503 (plain text) at once.
    """

    header_timeout: float = 10.0
    keep_alive: float = 5.0
    limit_concurrency: int = 256

    def uvicorn_options(self) -> dict:
        """The options of ``uvicorn.Config`` that carry these limits."""
        return {
            "http": header_timeout_protocol(self.header_timeout),
            "timeout_keep_alive": self.keep_alive,
            "limit_concurrency": self.limit_concurrency,
        }


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline for a request's headers.

    Why: uvicorn arms no timer while it waits for a request's headers (its keep-alive timer runs only
    between requests, and any byte received cancels it), so a client that opens a connection and
    sends nothing, or trickles a header a byte at a time, holds the connection open indefinitely.
    Here a timer starts when the connection opens and when each answer completes, and is cancelled
    once h11 has parsed a whole request line and headers; when it fires the connection is closed.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in: the body has its own timeout
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeout


def serve_forever(settings, host: str, port: int, **options) -> None:
    """Run the app over ``settings`` under uvicorn until SIGINT/SIGTERM (:func:`run_uvicorn`, with its
    keyword ``options``); on shutdown uvicorn stops accepting, lets running requests finish, then the
    app's lifespan finishes the worker's queued jobs and closes every memory."""
    from eventkv.service.app import create_app

    check_bind(host, settings.tokens)
    run_uvicorn(create_app(settings), host, port, **options)


def run_uvicorn(
    app,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    graceful_s: float = 30.0,
    connections: Connections | None = Connections(),
) -> None:
    """Run the ASGI ``app`` under uvicorn on ``host:port`` until SIGINT/SIGTERM, with the timeouts and
    connection limit of ``connections`` (:class:`Connections`; None: uvicorn's own); running requests get
    ``graceful_s`` seconds to finish; ``log_level``: uvicorn's. The process then exits 0 through the
    caller's cleanup (:func:`stops_cleanly`)."""
    import uvicorn

    # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done (so a parent sees the signal);
    # with these handlers in place it then exits 0: the shutdown was clean (the lifespan closed every store)
    with stops_cleanly():
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            # ignored: uvicorn annotates int but only passes it to asyncio.wait_for, which takes seconds as float
            timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
            **(connections.uvicorn_options() if connections is not None else {}),
        )


@contextmanager
def stops_cleanly() -> Iterator[None]:
    """A server's stop: while the block runs, SIGTERM and SIGINT (Ctrl-C) raise ``SystemExit(0)`` in the
    main thread, so the ``finally`` blocks on the way out close every memory and the process exits 0 (a
    signal before the server listens, e.g. while the model loads, exits 0 too: nothing was acknowledged
    yet). Under uvicorn its own handlers come first (stop accepting, let running requests finish) and it
    re-raises the signal here once it is done. The previous handlers are restored on leaving; in a thread
    other than the main one nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


class ServerProcess:
    """``eventkv serve --model MODEL --store STORE --host 127.0.0.1 --port 0 ARGS`` in a subprocess,
    for tests, benchmarks and notebooks: waits until uvicorn reports its port (``url`` is then set),
    keeps the server's output in ``lines``; :meth:`stop` is a graceful SIGTERM, :meth:`kill` a SIGKILL.
    The port is read from uvicorn's startup line, so keep ``--log-level`` at ``info`` or below.

    Raises:
        EventKVError: the server exited or printed no address within ``timeout`` seconds (its last
            output in the message).
    """

    RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")

    def __init__(self, model: str | Path, store: str | Path, *args: str, timeout: float = 180.0) -> None:
        start = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"
        cmd = [sys.executable, "-c", start, "serve", "--model", str(model), "--store", str(store)]
        cmd += ["--host", "127.0.0.1", "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.port: int | None = None
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = self.RUNNING.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout) or self.port is None:
            self.kill()
            code = self.proc.returncode
            raise EventKVError(f"the server did not start (exit code {code}):\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the exit code (0 after a graceful shutdown)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (no shutdown at all) and wait; nothing when it has exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def log(self) -> str:
        """Everything the server printed so far."""
        time.sleep(0.1)
        return "".join(self.lines)

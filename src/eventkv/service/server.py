"""Start the service: token file, bind-address rule, uvicorn (issue 12, points 1 and 3)."""

from __future__ import annotations

import ipaddress
import signal
import socket
from pathlib import Path

from eventkv.errors import OptionError
from eventkv.service.names import check_name


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
    """Refuse a non-loopback bind without tokens (issue 12, point 3).

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


def serve_forever(settings, host: str, port: int, *, log_level: str = "info", graceful_s: float = 30.0) -> None:
    """Run the app under uvicorn until SIGINT/SIGTERM; on shutdown uvicorn stops accepting, lets
    running requests finish (at most ``graceful_s`` seconds), then the app's lifespan finishes the
    worker's queued jobs and closes every memory."""
    import uvicorn

    from eventkv.service.app import create_app

    check_bind(host, settings.tokens)
    app = create_app(settings)
    # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done (so a parent sees the signal);
    # with these handlers in place it then exits 0: the shutdown was clean (the lifespan closed every store)
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)

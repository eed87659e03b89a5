"""What one ``eventkv mcp`` serves: :class:`MCPOptions` (the backend, the namespace, the default
memory, the transport), checked by :meth:`MCPOptions.validate` before any model loads, then run
by :meth:`MCPOptions.serve`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eventkv.errors import EventKVError, OptionError
from eventkv.options import check_int, check_threads
from eventkv.wire import DEFAULT_MEMORY, DEFAULT_NAMESPACE, check_name

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.mcp.backends import Backend

TRANSPORTS = ("stdio", "http")


@dataclass
class MCPOptions:
    """One MCP server.

    Attributes:
        model: the model of a local store (alias, directory, hub id or GGUF); None with ``server``.
        store: the local store root (``store/<namespace>/<memory id>/``, as ``eventkv serve --store``).
        server: the URL of a running ``eventkv serve`` instead of a local store.
        token_file: with ``server``: the bearer token, the first of a token file (``eventkv serve``'s format).
        namespace: the one namespace of every tool call (mem0's user_id).
        memory: the memory of a call that names no ``memory_id``.
        instruction: the header instruction of a memory that ``add_memory`` creates (local store).
        rows: the row format of a memory that ``add_memory`` creates: native, int8 or int4 (either backend).
        transport: ``stdio`` (one client on stdin/stdout) or ``http`` (streamable HTTP at ``/mcp``).
        host, port: where ``http`` listens (a loopback host only: the MCP server has no authentication).
        dtype, device, threads: the local model's, as elsewhere. max_open: memories kept open (local store).
        log_level: uvicorn's (``http``).
    """

    model: str | None = None
    store: Path | None = None
    server: str | None = None
    token_file: Path | None = None
    namespace: str = DEFAULT_NAMESPACE
    memory: str = DEFAULT_MEMORY
    instruction: str | None = None
    rows: str = "native"
    transport: str = "stdio"
    host: str = "127.0.0.1"
    port: int = 8765
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    max_open: int = 16
    log_level: str = "info"

    def validate(self) -> "MCPOptions":
        """Check every option (nothing loads).

        Raises:
            EventKVError: neither ``store`` nor ``server``.
            OptionError: both ``store`` and ``server``; ``store`` without ``model``, or
                ``model`` with ``server``; ``token_file`` without ``server``, unreadable, or not granting
                ``namespace``; a server URL that is not http(s); a bad namespace or memory id; an unknown
                transport; a non-loopback host, a bad or taken port (``http``); a bad dtype, device,
                thread count or ``max_open``.
        """
        if self.store is None and self.server is None:
            raise EventKVError(
                "eventkv mcp needs a backend: --store DIR with --model (a local store), or --server URL "
                "(a running eventkv serve)."
            )
        if self.store is not None and self.server is not None:
            raise OptionError(
                "server", self.server, f"give --server or --store ({str(self.store)!r}), not both.", flag="--server"
            )
        if self.store is not None:
            if self.model is None:
                raise OptionError(
                    "store", str(self.store), "a local store needs --model M (the model its memories use).", "--store"
                )
            if self.store.exists() and not self.store.is_dir():
                raise OptionError("store", str(self.store), "the store is a file: give a directory.", flag="--store")
            if self.token_file is not None:
                raise OptionError(
                    "token_file",
                    str(self.token_file),
                    "a token is for --server (a local store has no server to show it to).",
                    flag="--token-file",
                )
        else:
            if self.model is not None:
                raise OptionError(
                    "model", self.model, "leave --model out with --server: the server serves its own model.", "--model"
                )
            if not re.match(r"^https?://[^/\s]+", self.server or ""):
                raise OptionError(
                    "server", self.server, "give the server's URL, e.g. http://127.0.0.1:8000.", flag="--server"
                )
            self.token()
        check_name(self.namespace, "namespace")
        check_name(self.memory, "memory")
        from eventkv.kv.quant import check_row_format

        check_row_format(self.rows)
        if self.transport not in TRANSPORTS:
            raise OptionError("transport", self.transport, "give stdio or http.", flag="--transport")
        if self.transport == "http":
            from eventkv.service.server import check_port, is_loopback

            if not is_loopback(self.host):
                raise OptionError(
                    "host",
                    self.host,
                    "the MCP server has no authentication: bind a loopback address (127.0.0.1), or put an "
                    "authenticating proxy in front of it.",
                    flag="--host",
                )
            check_int("port", self.port, "give a TCP port, 0-65535 (0: any free port).", minimum=0, flag="--port")
            if self.port > 65535:
                raise OptionError("port", self.port, "give a TCP port, 0-65535 (0: any free port).", flag="--port")
            check_port(self.host, self.port)
        check_int("max_open", self.max_open, "keep at least 1 memory open.", flag="--max-open")
        if self.store is not None:
            from eventkv.models import resolve_device, resolve_dtype

            resolve_dtype(self.dtype, resolve_device(self.device)[0])
            self.threads = check_threads(self.threads)
        return self

    def token(self) -> str | None:
        """The bearer token for ``server``: the first token of ``token_file`` (None without one).

        Raises:
            OptionError: as :func:`eventkv.service.server.read_tokens`; the token is not granted ``namespace``.
        """
        if self.token_file is None:
            return None
        from eventkv.service.server import read_tokens

        token, granted = next(iter(read_tokens(self.token_file).items()))
        if granted is not None and self.namespace not in granted:
            raise OptionError(
                "namespace",
                self.namespace,
                f"the token of {self.token_file} is granted {', '.join(sorted(granted))} only: give one of "
                "them with --namespace.",
                flag="--namespace",
            )
        return token

    def backend(self) -> Backend:
        """The backend the tools run on: the local store (the model loaded here) or the server (its
        ``/health`` checked).

        Raises:
            EventKVError: the model does not load; the server does not answer.
        """
        from eventkv.mcp.backends import LocalStore, RemoteServer

        if self.server is not None:
            remote = RemoteServer(self.server, self.namespace, token=self.token(), rows=self.rows)
            remote.health()
            return remote
        from eventkv.models import load

        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        assert self.model is not None and self.store is not None  # validate() refused anything else
        lm = load(self.model, dtype=self.dtype, device=self.device)
        return LocalStore(
            lm, self.store, self.namespace, instruction=self.instruction, rows=self.rows, max_open=self.max_open
        )

    def serve(self) -> None:
        """Run the MCP server until its client goes (stdio: stdin closes) or SIGTERM or SIGINT (either
        transport; also while the model loads); every memory is let go of at the end, and a signal exits
        the process with status 0 (:func:`eventkv.mcp.server.run_stdio`, :func:`eventkv.mcp.server.run_http`)."""
        from eventkv.mcp.server import build_server, run_http, run_stdio
        from eventkv.service.server import stops_cleanly

        with stops_cleanly():
            backend = self.backend()
            try:
                server = build_server(backend, self.memory)
                if self.transport == "http":
                    run_http(server, self.host, self.port, log_level=self.log_level)
                else:
                    run_stdio(server, close=backend.close)
            finally:
                backend.close()

"""``eventkv mcp``: the memory as Model Context Protocol tools (:mod:`eventkv.mcp`), over stdio or
streamable HTTP, on a local store or a running ``eventkv serve``. Option errors print one line and
exit 2 before the model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eventkv.cli.common import DEVICE_OPTION, DTYPE_OPTION, MODEL_HELP, THREADS_OPTION, user_errors


def mcp(
    model: Optional[str] = typer.Option(None, "--model", help=f"{MODEL_HELP}; with --store"),
    store: Optional[Path] = typer.Option(
        None, "--store", help="root of a local store (DIR/<namespace>/<memory id>/, as eventkv serve --store)"
    ),
    server: Optional[str] = typer.Option(
        None, "--server", help="URL of a running eventkv serve, instead of --store (e.g. http://127.0.0.1:8000)"
    ),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="with --server: its bearer token (the first token of the file)"
    ),
    namespace: str = typer.Option("default", "--namespace", help="the namespace of every call (mem0's user_id)"),
    memory: str = typer.Option("default", "--memory", help="the memory of a call that names no memory_id"),
    instruction: Optional[str] = typer.Option(
        None, "--instruction", help="the header instruction of a memory add_memory creates (--store)"
    ),
    rows: str = typer.Option(
        "native", "--rows", help="the row format of a memory add_memory creates: native, int8 or int4"
    ),
    transport: str = typer.Option("stdio", "--transport", help="stdio (one client) or http (streamable HTTP at /mcp)"),
    host: str = typer.Option("127.0.0.1", "--host", help="--transport http: bind address (loopback only)"),
    port: int = typer.Option(8765, "--port", help="--transport http: TCP port (0: any free port)"),
    max_open: int = typer.Option(16, "--max-open", help="memories kept open (rows in RAM; --store)"),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level (--transport http)"),
) -> None:
    """Serve the memory as MCP tools, over stdio or streamable HTTP (the server extra: pip install 'eventkv\\[server]').

    Tools: add_memory, search_memory, query_memory, update_memory, memory_history, delete_memory, forget_memory.
    """
    with user_errors():
        from eventkv.errors import EventKVError

        try:
            import mcp as sdk  # noqa: F401
        except ImportError as exc:
            raise EventKVError(
                f"eventkv mcp needs the server extra ({exc.name} is not installed): pip install 'eventkv[server]'."
            ) from None
        from eventkv.mcp.options import MCPOptions

        options = MCPOptions(
            model=model,
            store=store,
            server=server,
            token_file=token_file,
            namespace=namespace,
            memory=memory,
            instruction=instruction,
            rows=rows,
            transport=transport,
            host=host,
            port=port,
            dtype=dtype,
            device=device,
            threads=threads,
            max_open=max_open,
            log_level=log_level,
        )
        options.validate().serve()

"""The MCP server over a :class:`~eventkv.mcp.backends.Backend`: :func:`build_server` (the SDK's
low-level :class:`mcp.server.lowlevel.Server` with the tools of :mod:`eventkv.mcp.tools`), run over
stdio (:func:`run_stdio`) or streamable HTTP (:func:`run_http`).

Why the low-level server and not ``MCPServer`` (the SDK's decorator API): ``MCPServer`` derives a
tool's input schema and a lax validation model from a function's signature, so ``"3"`` would pass as
3 and unknown fields would be dropped; here the input schema and the validation are the service's own
request models (strict, unknown fields refused), so a tool refuses exactly what its HTTP route refuses.

Every failure is a tool result with ``isError`` set and one text block ``"<code>: <message>"``, the
code and message the HTTP service answers with (``invalid_request``, ``not_found``, ``gone``,
``conflict``, ``refused``, ...; docs/service.md, "Errors"); the server never crashes on a call.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server
from pydantic import ValidationError

from eventkv import __version__
from eventkv.errors import EventKVError
from eventkv.mcp.backends import Backend
from eventkv.mcp.tools import TOOLS, MemoryTool
from eventkv.service.errors import status_and_code, validation_message
from eventkv.wire import DEFAULT_MEMORY, ServiceError, check_name

__all__ = ["INSTRUCTIONS", "build_server", "run_http", "run_stdio"]

log = logging.getLogger("eventkv.mcp")

INSTRUCTIONS = (
    "eventkv memory: an agent's events (conversation turns, facts, tool results) stored verbatim with their "
    "transformer KV rows. add_memory stores one; search_memory returns the most relevant ones ranked with "
    "scores, to compose a prompt; query_memory has the served model answer from their stored rows; "
    "update_memory, delete_memory and forget_memory change them; memory_history shows an event's patches. "
    "Every tool takes memory_id (default {memory!r}) in namespace {namespace!r}."
)


def tool_error(message: str) -> types.CallToolResult:
    """The result of a failed call: ``isError`` with ``message`` as its one text block."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


def error_message(exc: BaseException, backend: Backend) -> str:
    """``"<code>: <message>"`` of an exception a call raised: a server's answer as it came (its code and
    message), a library error with the code the HTTP service gives it, anything else as ``internal``."""
    if isinstance(exc, ServiceError):
        return f"{exc.code}: {exc.message}"
    if isinstance(exc, EventKVError):
        return f"{status_and_code(exc)[1]}: {backend.scrub(str(exc))}"
    return f"internal: internal error ({type(exc).__name__}): please report it."


def tool_listing(tool: MemoryTool) -> types.Tool:
    """The ``tools/list`` entry of ``tool``: its input schema is its argument model's JSON schema."""
    return types.Tool(
        name=tool.name,
        title=tool.title,
        description=tool.description,
        input_schema=tool.args.model_json_schema(),
        output_schema=tool.result.model_json_schema(),
        annotations=tool.annotations,
    )


def build_server(backend: Backend, memory: str = DEFAULT_MEMORY) -> Server:
    """The MCP server of the tools (:data:`eventkv.mcp.tools.TOOLS`) on ``backend``; a call without
    ``memory_id`` works on memory ``memory``.

    Raises:
        OptionError: ``memory`` is not a valid memory id.
    """
    default = check_name(memory, "memory id")
    by_name = {t.name: t for t in TOOLS}
    listing = [tool_listing(t) for t in TOOLS]

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listing)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = by_name.get(params.name)
        if tool is None:
            return tool_error(f"not_found: no tool {params.name!r}: the tools are {', '.join(by_name)}.")
        try:
            args = tool.args.model_validate(params.arguments or {})
        except ValidationError as exc:
            return tool_error("invalid_request: " + validation_message(exc.errors(), "see the tool's input schema"))
        mid = args.memory_id or default
        try:
            out = await backend.run(mid, lambda mem: tool.verb(mem, args, mid), create=tool.creates)
        except Exception as exc:  # every failure is the caller's to read, never a crash of the server
            if not isinstance(exc, EventKVError):
                log.exception("tool %s failed", tool.name)
            return tool_error(error_message(exc, backend))
        data = out.model_dump(mode="json")
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(data, ensure_ascii=False))],
            structured_content=data,
        )

    return Server(
        "eventkv",
        version=__version__,
        title="eventkv memory",
        instructions=INSTRUCTIONS.format(memory=default, namespace=backend.namespace),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def run_stdio(server: Server, close: Callable[[], None] = lambda: None) -> None:
    """Serve one MCP client on this process's stdin and stdout until stdin closes, then return; or
    until SIGTERM or SIGINT (Ctrl-C), even with stdin open: then ``close()`` (the backend lets go of
    every memory: the calls already queued finish, every store is closed; answers not yet written are
    not sent) and the process exits 0."""
    import anyio
    from mcp.server.stdio import stdio_server

    async def stop_on_signal(*, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                log.info("%s: closing every memory", signal.Signals(signum).name)
                close()
                logging.shutdown()
                sys.stderr.flush()
                # why os._exit: the SDK's transport reads stdin on a worker thread that no cancellation
                # interrupts (anyio's readline is not abandoned on cancel), so a normal exit would wait for
                # the client's next line; the memories are closed, nothing else is left to flush
                os._exit(0)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(stop_on_signal)  # before the transport reads: no signal finds it unwatched
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
            tg.cancel_scope.cancel()

    anyio.run(main)


def run_http(server: Server, host: str, port: int, *, log_level: str = "info", graceful_s: float = 30.0) -> None:
    """Serve MCP's streamable HTTP transport at ``http://host:port/mcp`` under uvicorn until
    SIGINT/SIGTERM; open requests and streams then get ``graceful_s`` seconds to finish, as under
    ``eventkv serve``, and ``SystemExit(0)`` is raised through the caller's cleanup (every memory let go
    of; :func:`eventkv.service.server.stops_cleanly`). The SDK's app: on a loopback host it refuses
    requests whose ``Host`` or ``Origin`` is not a loopback name, against DNS rebinding."""
    from eventkv.service.server import run_uvicorn

    # graceful_s bounds the shutdown: a client's open event stream (GET /mcp) would otherwise hold it up
    # until the client goes; uvicorn's own connection settings (the SDK's app has its own session handling)
    run_uvicorn(
        server.streamable_http_app(host=host), host, port, log_level=log_level, graceful_s=graceful_s, connections=None
    )

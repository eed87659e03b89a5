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


def run_stdio(server: Server) -> None:
    """Serve one MCP client on this process's stdin and stdout until stdin closes."""
    import anyio
    from mcp.server.stdio import stdio_server

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def run_http(server: Server, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve MCP's streamable HTTP transport at ``http://host:port/mcp`` under uvicorn until
    SIGINT/SIGTERM, then return (the SDK's app: on a loopback host it refuses requests whose ``Host`` or ``Origin``
    is not a loopback name, against DNS rebinding)."""
    import signal

    import uvicorn

    def exit_cleanly(signum, frame) -> None:
        raise SystemExit(0)

    app = server.streamable_http_app(host=host)
    # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done; with these handlers the process
    # then exits 0 through the caller's cleanup (every memory let go of) instead of dying of the signal
    previous = {sig: signal.signal(sig, exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

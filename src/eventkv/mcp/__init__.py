"""``eventkv mcp``: the memory's verbs as Model Context Protocol tools, on the official ``mcp`` SDK,
over stdio or streamable HTTP (``docs/service.md``, "MCP").

The parts: the tools (:mod:`eventkv.mcp.tools`: argument models from the HTTP service's request
bodies, results, one verb each on :class:`eventkv.memory.api.MemoryAPI`), the backends the tools
run on (:mod:`eventkv.mcp.backends`: a local store on one model thread, or a running
``eventkv serve`` through :class:`eventkv.client.Client`) and the server (:mod:`eventkv.mcp.server`).
"""

from eventkv.mcp.backends import Backend, LocalStore, RemoteServer
from eventkv.mcp.server import build_server, run_http, run_stdio
from eventkv.mcp.tools import TOOLS, MemoryTool

__all__ = ["TOOLS", "Backend", "LocalStore", "MemoryTool", "RemoteServer", "build_server", "run_http", "run_stdio"]

"""The memory inspector: ``/ui`` of ``eventkv serve``, server-rendered pages that show what a memory holds,
what a question was served and why, and the same question under several serving plans side by side.

The pages are Jinja2 templates rendered by the server (:mod:`.pages`); their interactive parts use htmx
(2.0, 0BSD, its one minified file packaged under ``static/``), which swaps server-rendered fragments into the
page: no front-end framework and no build step, and the HTML a test reads is the HTML the server wrote. The
small ``static/ui.js`` adds what htmx leaves to the page: the bearer token and namespace sent with every
fragment request, JSON bodies for the write routes, and the error messages shown.

Auth: the shells (``/ui``, ``/ui/memory/<id>``, ``/ui/reports``) and ``/ui/static`` are public, as ``/docs``
is: they hold no memory's data. Every fragment (``/ui/part/...``) and every write goes through the bearer
token and the namespace grant of the JSON routes; the token is entered once and kept in the tab's
``sessionStorage`` (gone when the tab closes), and a restricted token's fragments of another namespace are
refused 403 as the JSON routes' are. Writes use the JSON routes themselves with ``expected_version`` (a
stale page gets the 409 and its message).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

#: where the inspector's scripts and styles are served from
UI_ASSETS = "/ui/static"
#: the prefix of the fragments, which need the bearer token when the server has tokens
UI_PARTS = "/ui/part/"


def is_ui_shell(path: str) -> bool:
    """Whether ``path`` is one of the inspector's public pages or assets (not a fragment)."""
    return (path == "/ui" or path.startswith("/ui/")) and not path.startswith(UI_PARTS)


def mount(app: FastAPI) -> None:
    """Add the inspector to ``app``: its shells, its fragments and its packaged assets, and the query log
    the memory page's figure reads (:class:`eventkv.service.ui.views.QueryLog`)."""
    from eventkv.service.ui import pages, views

    app.state.query_log = views.QueryLog()
    app.state.snapshots = views.Snapshots()
    app.include_router(pages.shells)
    app.include_router(pages.parts)
    app.mount(UI_ASSETS, StaticFiles(directory=Path(__file__).parent / "static"), name="ui-assets")


__all__ = ["UI_ASSETS", "UI_PARTS", "is_ui_shell", "mount"]

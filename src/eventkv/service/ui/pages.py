"""The inspector's routes: the page shells under ``/ui`` (public: they hold no memory's data) and the
fragments under ``/ui/part`` (behind the bearer token and the namespace grant, as every data route), which
the shells load with htmx, sending the token and namespace the tab keeps."""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from eventkv.errors import EventKVError, NotFound, OptionError, StoreDamaged
from eventkv.service import schemas
from eventkv.service.state import MemoryId, Namespace, ServiceState, State, Work
from eventkv.service.ui import views
from eventkv.wire import DEFAULT_NAMESPACE, NAME

HERE = Path(__file__).parent
TEMPLATES = Jinja2Templates(directory=HERE / "templates")
TEMPLATES.env.filters["bytes"] = views.human_bytes

#: the plans of the side-by-side, by key: (label, select, mode, positions)
PLANS: dict[str, tuple[str, Any, str, str | None]] = {
    "rows-original": ("rows · original positions", None, "compact", "original"),
    "rows-contiguous": ("rows · contiguous positions", None, "compact", "contiguous"),
    "isolated": ("isolated · contiguous", None, "isolated", "contiguous"),
    "blend": ("blend · contiguous", None, "blend", "contiguous"),
    "text": ("text (the served turns re-prefilled)", None, "text", None),
    "full": ("full history", "all", "compact", "original"),
}
DEFAULT_PLANS = ("rows-original", "rows-contiguous", "text")

shells = APIRouter(include_in_schema=False)
parts = APIRouter(prefix="/ui/part", include_in_schema=False)


def shell(request: Request, template: str, **extra: Any) -> HTMLResponse:
    """A page shell: the layout, the token form when the server has tokens, and the fragments to load. The
    namespace comes from ``?ns=`` (checked as a name; a bad one falls back to the default, and the fragments
    are then refused by the route's own check)."""
    ns = request.query_params.get("ns") or DEFAULT_NAMESPACE
    if NAME.fullmatch(ns) is None:
        ns = DEFAULT_NAMESPACE
    state: ServiceState = request.app.state.service
    ctx = dict(ns=ns, tokens=bool(state.settings.tokens), served=state.served, plans=PLANS, **extra)
    return TEMPLATES.TemplateResponse(request, template, ctx)


@shells.get("/ui", response_class=HTMLResponse)
def memories_page(request: Request):
    return shell(request, "memories.html", page="memories")


@shells.get("/ui/memory/{mid}", response_class=HTMLResponse)
def memory_page(request: Request, mid: MemoryId):
    return shell(request, "memory.html", page="memory", mid=mid, default_plans=DEFAULT_PLANS)


@shells.get("/ui/reports", response_class=HTMLResponse)
def reports_page(request: Request):
    return shell(request, "reports.html", page="reports")


def part(request: Request, template: str, headers: dict[str, str] | None = None, **ctx: Any) -> HTMLResponse:
    return TEMPLATES.TemplateResponse(request, template, ctx, headers=headers)


@parts.get("/memories", response_class=HTMLResponse)
def memory_list(request: Request, ns: Namespace, state: State, q: str = "", page: int = 1):
    """The namespace's memories whose id holds ``q``, a page of :data:`views.PAGE_SIZE`: id, events, rows, KV
    bytes on disk, version, row format; a damaged memory marked with what is damaged."""
    base = state.root / ns
    dirs = sorted(p for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []
    dirs = [d for d in dirs if (d / "manifest.json").is_file() and q.strip().lower() in d.name.lower()]
    pages = max(1, -(-len(dirs) // views.PAGE_SIZE))
    page = min(max(1, page), pages)
    items: list[dict[str, Any]] = []
    for d in dirs[(page - 1) * views.PAGE_SIZE : page * views.PAGE_SIZE]:
        try:
            snap = request.app.state.snapshots.read(d)
            items.append(
                dict(id=d.name, stats=snap.stats, version=snap.version, rows=snap.manifest.get("rows", "native"))
            )
        except StoreDamaged as exc:
            items.append(dict(id=d.name, damaged=state.scrub(str(exc))))
        except EventKVError:
            continue  # deleted while listed
    return part(request, "part_memories.html", ns=ns, items=items, q=q, page=page, pages=pages, matched=len(dirs))


def snapshot(request: Request, state: ServiceState, ns: str, mid: str):
    """The committed snapshot of memory ``mid`` (:class:`eventkv.service.ui.views.Snapshots`).

    Raises:
        NotFound: no such memory. StoreDamaged: its store fails its checks.
    """
    return request.app.state.snapshots.read(state.existing(ns, mid))


@parts.get("/memory/{mid}/summary", response_class=HTMLResponse)
def memory_summary(request: Request, mid: MemoryId, ns: Namespace, state: State):
    snap = snapshot(request, state, ns, mid)
    figure = request.app.state.query_log.figure(f"{ns}/{mid}")
    return part(
        request, "part_summary.html", ns=ns, mid=mid, snap=snap, rows=snap.manifest.get("rows", "native"), figure=figure
    )


@parts.get("/memory/{mid}/timeline", response_class=HTMLResponse)
def memory_timeline(
    request: Request,
    mid: MemoryId,
    ns: Namespace,
    state: State,
    page: int = 1,
    q: str = "",
    served: str = "",
    served_only: bool = False,
):
    """A page of the memory's timeline (every stored event in history order), filtered by ``q``; ``served``:
    the comma-separated ids of the last query's served set (highlighted on the page and the strip)."""
    snap = snapshot(request, state, ns, mid)
    records = snap.table.records  # every stored record: list() leaves the forgotten ones out
    chosen = [s for s in served.split(",") if s]
    tl = views.timeline(records, page, q, chosen, served_only)
    with_rows = sorted(x.seq for x in records if x.row_start is not None)
    # forget re-prefills every later event that had rows: the confirmation says how many
    later = {row.record.id: len(with_rows) - bisect_right(with_rows, row.record.seq) for row in tl.rows}
    return part(
        request,
        "part_timeline.html",
        ns=ns,
        mid=mid,
        tl=tl,
        q=q,
        served=served,
        served_only=served_only,
        version=snap.version,
        strip=views.strip(records, chosen),
        later=later,
    )


@parts.get("/memory/{mid}/event/{eid}/history", response_class=HTMLResponse)
def event_history(request: Request, mid: MemoryId, eid: str, ns: Namespace, state: State):
    table = snapshot(request, state, ns, mid).table
    try:
        chain = table.history(eid)
    except StoreDamaged:
        raise
    except EventKVError:
        raise NotFound(f"no event {eid!r} in memory {mid!r}.") from None
    return part(request, "part_history.html", chain=chain)


async def form(request: Request) -> dict[str, list[str]]:
    """The request's url-encoded form (htmx's default encoding): every value of each field, in order."""
    return parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)


def last(fields: dict[str, list[str]]) -> dict[str, str]:
    """The last value of each field of a :func:`form`."""
    return {k: v[-1] for k, v in fields.items()}


def shaping(fields: dict[str, str]) -> dict[str, Any]:
    """The form's question and shaping as :class:`eventkv.service.schemas.QueryIn`'s fields (numbers parsed;
    the budget given as rows or as a fraction, by ``budget_kind``).

    Raises:
        OptionError: a field that is not a number where one is needed.
    """

    def number(name: str, kind: type, default: Any = None) -> Any:
        raw = fields.get(name, "").strip()
        if not raw:
            return default
        try:
            return kind(raw)
        except ValueError:
            raise OptionError(name, raw, f"give a {'whole number' if kind is int else 'number'}.") from None

    out: dict[str, Any] = dict(
        question=fields.get("question", ""),
        k=number("k", int),
        neighbours=number("neighbours", int, 0),
        with_headers=fields.get("with_headers") == "on",
        max_new_tokens=number("max_new_tokens", int, 32),
    )
    if fields.get("selector"):
        out["selector"] = fields["selector"]
    kind = fields.get("budget_kind", "fraction")
    if kind == "rows":
        out["budget_rows"] = number("budget", int)
    else:
        pct = number("budget", float)
        if pct is not None and not 0 < pct <= 100:
            raise OptionError("budget", pct, "give a percentage of the memory's rows, above 0 and at most 100.")
        out["budget"] = None if pct is None else pct / 100
    return out


def checked(**fields: Any) -> schemas.QueryIn:
    """``fields`` as a :class:`eventkv.service.schemas.QueryIn`: the JSON route's limits, so the page and
    the API refuse the same requests.

    Raises:
        OptionError: a field out of its limits (its first error, worded as the API's 422).
    """
    try:
        return schemas.QueryIn(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(x) for x in err.get("loc", ())) or "query"
        raise OptionError(name, err.get("input"), schemas.pydantic_rule(dict(err)) + ".") from None


@parts.post("/memory/{mid}/query", response_class=HTMLResponse)
async def query(request: Request, mid: MemoryId, ns: Namespace, state: State, jobs: Work):
    """One question under one plan: the answer and its tokens' log-probs, the served set with each selector's
    rank and score, the rows and KV bytes served, the positions used, and the latency split (select, lazy
    prefill, serve, readout). The served ids go back to the timeline (an out-of-band swap and the
    ``served-changed`` event), which highlights them."""
    fields = last(await form(request))
    body = checked(
        **shaping(fields),
        mode=fields.get("mode", "compact"),
        positions=fields.get("positions") or None,
    )
    d = state.existing(ns, mid)
    q = replace(body.query(), keep_logits=True)  # the answer's tokens get their log-probs

    def job():
        from eventkv.memory import answer_prepared

        mem = jobs.open_checked(d, None)
        t0 = time.perf_counter()
        mem.selection().select(q.question, q.options)
        select_ms = 1000 * (time.perf_counter() - t0)
        ranks = views.selector_ranks(mem.selection(), q.question)
        prepared = mem.prepare_query(q)
        answer = answer_prepared(state.lm, [prepared])[0][0]
        mem.finish_query(q, [answer])
        return answer, ranks, select_ms, mem.stats().rows, prepared.version

    answer, ranks, select_ms, view_rows, version = await jobs.run(job, d)
    request.app.state.query_log.add(f"{ns}/{mid}", answer, view_rows)
    records = {r.id: r for r in snapshot(request, state, ns, mid).table.list(True, True)}
    served = [dict(id=eid, first=first, width=width, record=records.get(eid)) for eid, first, width in answer.positions]
    headers = {"HX-Trigger-After-Swap": "served-changed, queried"}
    return part(
        request,
        "part_answer.html",
        headers=headers,
        answer=answer,
        tokens=views.answer_tokens(state.lm.tokenizer, answer),
        served=served,
        ranks=ranks,
        ranked_by=views.RANKED_BY,
        select_ms=select_ms,
        kv_bytes=answer.n_rows_served * state.lm.profile.kv_row_bytes,
        view_rows=view_rows,
        version=version,
    )


@parts.post("/memory/{mid}/compare", response_class=HTMLResponse)
async def compare(request: Request, mid: MemoryId, ns: Namespace, state: State, jobs: Work):
    """The same question under two or more plans (:data:`PLANS`), prepared on one memory and read out in one
    batched pass (:func:`eventkv.memory.answer.answer_prepared`): what ``eventkv memory eval`` compares, for
    one question.

    Raises:
        OptionError: fewer than two plans ticked, or an unknown one.
    """
    every = await form(request)
    fields = last(every)
    keys = [k for k in every.get("plan", []) if k]
    unknown = [k for k in keys if k not in PLANS]
    if unknown or len(keys) < 2:
        raise OptionError("plan", ",".join(keys), f"tick two or more of {', '.join(PLANS)}.")
    base = shaping(fields)
    queries = []
    for key in keys:
        _, select, mode, positions = PLANS[key]
        queries.append(replace(checked(**base, mode=mode, positions=positions).query(), select=select))
    d = state.existing(ns, mid)

    def job():
        from eventkv.memory import answer_prepared

        mem = jobs.open_checked(d, None)
        prepared: list[Any] = []
        for x in queries:  # a plan the memory refuses (e.g. past the context) is shown with its reason
            try:
                prepared.append(mem.prepare_query(x))
            except EventKVError as exc:
                prepared.append(state.scrub(str(exc)))
        ready = [p for p in prepared if not isinstance(p, str)]
        t0 = time.perf_counter()
        read = iter([a[0] for a in answer_prepared(state.lm, ready)] if ready else [])
        readout_ms = 1000 * (time.perf_counter() - t0)
        answers = [p if isinstance(p, str) else next(read) for p in prepared]
        for x, a in zip(queries, answers):
            if not isinstance(a, str):
                mem.finish_query(x, [a])
        return answers, mem.stats().rows, readout_ms

    answers, view_rows, readout_ms = await jobs.run(job, d)
    for a in answers:
        if not isinstance(a, str):
            request.app.state.query_log.add(f"{ns}/{mid}", a, view_rows)
    lines = [
        dict(
            key=k, label=PLANS[k][0], answer=None if isinstance(a, str) else a, error=a if isinstance(a, str) else None
        )
        for k, a in zip(keys, answers)
    ]
    return part(
        request,
        "part_compare.html",
        headers={"HX-Trigger-After-Swap": "queried"},
        lines=lines,
        answered=sum(line["answer"] is not None for line in lines),
        readout_ms=readout_ms,
        view_rows=view_rows,
        row_bytes=state.lm.profile.kv_row_bytes,
    )


@parts.get("/reports", response_class=HTMLResponse)
def reports(request: Request, state: State):
    """The folders given with ``eventkv serve --report``: each one's summary and figures."""
    out, errors = [], []
    for folder in state.settings.reports:
        try:
            out.append(views.read_report(Path(folder)))
        except EventKVError as exc:
            errors.append(state.scrub(str(exc)))
    return part(request, "part_reports.html", reports=out, errors=errors)


__all__ = ["PLANS", "parts", "shells"]

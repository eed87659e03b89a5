"""The service's Prometheus metrics (prometheus-client): :class:`Metrics` holds one app's
registry (server-wide series: no namespace or memory in any label), :class:`Measure` is the ASGI
middleware that counts and times every request, and :class:`MemorySizes` the per-memory series of
the namespaces a token is granted, collected on each ``GET /metrics``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from eventkv.memory.reader import read_memory
from eventkv.wire import ERRORS, NAME

if TYPE_CHECKING:
    from eventkv.service.worker import ModelWorker

#: the HTTP methods a metric names; any other method is counted as "other" (a label's values stay few)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: the statuses the app answers with (499: the client went away before the answer; 400: the
#: OpenAI-compatible routes' bad request)
STATUSES = frozenset({200, 201, 400, 499} | {status for status, _ in ERRORS.values()})
#: the upper bounds of the ``eventkv_query_batch_size`` histogram's buckets (queries per readout)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    """One app's series: ``eventkv_requests`` (counter) and ``eventkv_request_seconds`` (histogram,
    seconds) by route template, method and status (:class:`Measure` feeds them),
    ``eventkv_queue_depth``, ``eventkv_jobs`` and ``eventkv_query_batch_size`` read from the worker
    ``worker()`` returns (None: not started, every value 0), and the per-memory series of the store
    ``root``.

    Args:
        root: the store root (``root/<namespace>/<memory id>/``).
        worker: returns the app's model worker, or None before it started.
    """

    def __init__(self, root: Path, worker: Callable[[], ModelWorker | None]) -> None:
        self.root, self.worker = root, worker
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "eventkv_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "eventkv_request_seconds",
            "HTTP request latency by route template and method (seconds)",
            ["route", "method"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        depth = Gauge("eventkv_queue_depth", "model jobs waiting", registry=self.registry)
        depth.set_function(lambda: w.depth if (w := self.worker()) is not None else 0)
        self.registry.register(self)

    def collect(self):
        """The ``eventkv_jobs`` counter (jobs started, and cancelled while queued), the ``eventkv_memory_events``
        counter (memories opened, closed, rows released), the ``eventkv_memories_open`` gauge, and the
        ``eventkv_query_batch_size`` histogram (queries per batched readout, :data:`BATCH_BUCKETS`)."""
        w = self.worker()
        jobs = CounterMetricFamily(
            "eventkv_jobs", "model jobs by outcome: started, or cancelled while queued", labels=["outcome"]
        )
        jobs.add_metric(["started"], w.started if w is not None else 0)
        jobs.add_metric(["cancelled"], w.cancelled if w is not None else 0)
        yield jobs
        memories = CounterMetricFamily(
            "eventkv_memory_events",
            "open memories on the model worker: opened (read from disk, segments checked), closed, and rows "
            "released (a quantized memory's dequantized rows dropped, --max-hot)",
            labels=["event"],
        )
        for what in ("opened", "closed", "released"):
            memories.add_metric([what], getattr(w, what) if w is not None else 0)
        yield memories
        open_now = GaugeMetricFamily("eventkv_memories_open", "memories the model worker holds open now")
        open_now.add_metric([], w.n_open if w is not None else 0)
        yield open_now
        sizes = dict(w.batches) if w is not None else {}
        buckets = [(str(float(b)), sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS]
        batch = HistogramMetricFamily("eventkv_query_batch_size", "queries answered per batched readout")
        batch.add_metric(
            [], [*buckets, ("+Inf", sum(sizes.values()))], sum_value=sum(size * n for size, n in sizes.items())
        )
        yield batch

    def text(self, granted: frozenset[str] | None) -> bytes:
        """Prometheus text: the server-wide series, then the per-memory series of the namespaces
        ``granted`` (None: every one)."""
        return generate_latest(self.registry) + generate_latest(MemorySizes(self.root, granted))


class MemorySizes:
    """The per-memory series of the namespaces a token is granted (``granted`` None: every one).
    Labels name only memories that exist (a directory with a manifest, under a valid name); a
    memory whose store cannot be read is left out and counted in ``eventkv_memories_damaged``,
    so one damaged memory never fails the whole answer."""

    def __init__(self, root: Path, granted: frozenset[str] | None) -> None:
        self.root, self.granted = root, granted

    def collect(self):
        rows = GaugeMetricFamily("eventkv_memory_rows", "rows of the stored history", labels=["namespace", "memory"])
        size = GaugeMetricFamily("eventkv_memory_bytes", "bytes on disk", labels=["namespace", "memory"])
        damaged = GaugeMetricFamily(
            "eventkv_memories_damaged", "memories whose store fails its checks", labels=["namespace"]
        )
        for nsdir in sorted(self.root.iterdir()):
            ns = nsdir.name
            if not nsdir.is_dir() or not NAME.fullmatch(ns) or (self.granted is not None and ns not in self.granted):
                continue
            bad = 0
            for d in sorted(nsdir.iterdir()):
                if not NAME.fullmatch(d.name) or not (d / "manifest.json").is_file():
                    continue
                try:
                    snap = read_memory(d)
                except Exception:  # StoreDamaged, or any other failure: never every memory's metrics
                    bad += (d / "manifest.json").is_file()  # not when it was deleted meanwhile
                    continue
                rows.add_metric([ns, d.name], snap.stats.rows)
                size.add_metric([ns, d.name], snap.stats.bytes_on_disk)
            if bad:
                damaged.add_metric([ns], bad)
        yield rows
        yield size
        yield damaged


class Measure:
    """ASGI middleware (outermost, so refusals by the other middleware count too): one request
    counter and one latency histogram, labelled by the route's template (``unmatched`` when no
    route matched: never the raw path), the method (:data:`METHODS`, else ``other``) and the status
    (:data:`STATUSES`, else its class, ``4xx``); so every label has a small, fixed set of values."""

    def __init__(self, app, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 499  # no answer started: the client went away first

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if status == 499:  # no answer was started: the server answers 500
                status = 500
            raise
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else "other"
            code = str(status) if status in STATUSES else f"{status // 100}xx"
            self.requests.labels(route, method, code).inc()
            self.latency.labels(route, method).observe(time.perf_counter() - t0)

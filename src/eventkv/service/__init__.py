"""eventkv.service: EventMemory behind HTTP. ``eventkv serve`` starts it; the client is
:class:`eventkv.client.Client`. See ``docs/service.md``. Needs the ``server`` extra
(``pip install 'eventkv[server]'``): FastAPI, uvicorn, prometheus-client."""

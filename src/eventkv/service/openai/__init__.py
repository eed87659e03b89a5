"""The OpenAI-compatible surface of the service, laid out as vLLM's ``entrypoints/openai``:
:mod:`.protocol` (the request and response bodies, OpenAI's error shape), :mod:`.serving` (the use
case without HTTP: the model card, a chat's job on the worker, the stream bridge and its server-sent
events) and :mod:`.router` (the thin ``APIRouter``: ``GET /v1/models``, ``GET /v1/models/{model}``,
``POST /v1/chat/completions``, each one call into :mod:`.serving`). The app includes the router after
the service's own (:mod:`eventkv.service.app`); errors on these paths are in OpenAI's shape
(:func:`eventkv.service.errors.error_answer`)."""

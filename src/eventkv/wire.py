"""The memory service's wire: the constants and exceptions both the server (:mod:`eventkv.service`)
and the client (:mod:`eventkv.client`) use — the namespace header, the error codes with their HTTP
statuses (:data:`ERRORS`), and the exceptions an answer stands for.

An error answer is JSON ``{"code", "message"}``; the client turns it back into the exception of
its code (:func:`error_for`), so ``except StoreDamaged`` catches the same failure from the library
and from a server."""

from __future__ import annotations

from eventkv.errors import EventKVError, OptionError, OutOfSpace, PurgePending, StoreDamaged

#: the request header that scopes a request to one namespace
NAMESPACE_HEADER = "X-EventKV-Namespace"
#: the namespace of a request without the header
DEFAULT_NAMESPACE = "default"
#: the request header that attaches a memory (by id) to a chat completion
MEMORY_HEADER = "X-EventKV-Memory"


class Unauthorized(EventKVError):
    """No bearer token, or a wrong one (HTTP 401 ``unauthorized``)."""


class Forbidden(EventKVError):
    """The token is not granted the request's namespace, or a body names another namespace than the
    request's (HTTP 403 ``forbidden``)."""


class NotFound(EventKVError):
    """An unknown memory, event or route (HTTP 404 ``not_found``)."""


class Conflict(EventKVError):
    """A write whose ``expected_version`` is behind the memory, a memory id or event id already taken
    (HTTP 409 ``conflict``)."""


class Gone(EventKVError):
    """The event was deleted or forgotten and the verb needs a live one (HTTP 410 ``gone``)."""


class InvalidRequest(OptionError):
    """A request outside its schema, a bad id or option, or a body that is not JSON (HTTP 422
    ``invalid_request`` / ``invalid_option``). An :class:`~eventkv.errors.OptionError`, so
    ``except OptionError`` catches a bad value from a server as it does from the library; only the
    server's message crosses the wire, so ``field`` and ``value`` are empty and ``allowed`` is that
    message."""

    def __init__(self, message: str) -> None:
        self.field, self.value, self.allowed, self.flag = "", None, message, ""
        EventKVError.__init__(self, message)

    def for_cli(self) -> str:
        return str(self)


class Refused(EventKVError):
    """A well-formed request the memory cannot carry out: an event longer than its position budget,
    a history past the model's context, a store made by other weights (HTTP 422 ``refused``)."""


class RequestTooLarge(EventKVError):
    """A request body over the server's ``--max-body`` (HTTP 413 ``body_too_large``)."""


class RequestTimeout(EventKVError):
    """A request body that did not arrive within the server's ``--body-timeout`` (HTTP 408 ``timeout``)."""


class QueueFull(EventKVError):
    """The model worker's queue is full: try again later (HTTP 503 ``busy`` + Retry-After)."""


class ShuttingDown(EventKVError):
    """The server is stopping and takes no new work (HTTP 503 ``shutting_down`` + Retry-After)."""


class MethodNotAllowed(EventKVError):
    """A route that exists, called with a method it does not take (HTTP 405; ``Allow`` lists them)."""


class InternalError(EventKVError):
    """A bug in the server (HTTP 500 ``internal``): please report it."""


#: every error code the service answers with: code -> (HTTP status, the exception it stands for)
ERRORS: dict[str, tuple[int, type[EventKVError]]] = {
    "unauthorized": (401, Unauthorized),
    "forbidden": (403, Forbidden),
    "not_found": (404, NotFound),
    "method_not_allowed": (405, MethodNotAllowed),
    "timeout": (408, RequestTimeout),
    "conflict": (409, Conflict),
    "damaged": (409, StoreDamaged),
    "gone": (410, Gone),
    "body_too_large": (413, RequestTooLarge),
    "invalid_request": (422, InvalidRequest),
    "invalid_option": (422, InvalidRequest),
    "refused": (422, Refused),
    "internal": (500, InternalError),
    "busy": (503, QueueFull),
    "shutting_down": (503, ShuttingDown),
    "purge_pending": (503, PurgePending),
    "insufficient_storage": (507, OutOfSpace),
}


class ServiceError(EventKVError):
    """An error answer of the memory service: ``status`` (HTTP), ``code`` and the server's message.
    Raised by the client as a subclass that is also the code's exception (:data:`ERRORS`)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


_RAISED: dict[type[EventKVError], type[ServiceError]] = {}


def error_for(status: int, code: str, message: str) -> ServiceError:
    """The exception the client raises for an error answer: a :class:`ServiceError` that is also
    the exception of ``code`` (:data:`ERRORS`); an unknown code (another server's, or a proxy's
    answer) falls back to the exception of the status's code, else a plain ServiceError."""
    kind = ERRORS.get(code, (status, None))[1]
    if kind is None:
        kind = next((k for s, k in ERRORS.values() if s == status), None)
    if kind is None:
        return ServiceError(status, code, message)
    if kind not in _RAISED:
        _RAISED[kind] = type(kind.__name__, (ServiceError, kind), {"__module__": __name__})
    return _RAISED[kind](status, code, message)

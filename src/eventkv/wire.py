"""The memory service's wire: the constants and exceptions both the server (:mod:`eventkv.service`)
and the client (:mod:`eventkv.client`) use — the namespace header, the rule for memory ids and
namespaces (:func:`check_name`), mem0's scopes as a namespace and a memory id (:func:`scope`), the
error codes with their HTTP statuses (:data:`ERRORS`), and the exceptions an answer stands for.

An error answer is JSON ``{"code", "message"}``; the client turns it back into the exception of
its code (:func:`error_for`), so ``except StoreDamaged`` catches the same failure from the library
and from a server."""

from __future__ import annotations

import re

from eventkv.errors import (
    Conflict,
    EventKVError,
    Gone,
    NotFound,
    OptionError,
    OutOfSpace,
    PurgePending,
    StoreDamaged,
    StoreLocked,
)

#: the request header that scopes a request to one namespace
NAMESPACE_HEADER = "X-EventKV-Namespace"
#: the namespace of a request without the header
DEFAULT_NAMESPACE = "default"
#: the request header that attaches a memory (by id) to a chat completion
MEMORY_HEADER = "X-EventKV-Memory"

#: a name (a memory id or a namespace; each becomes a directory): 1-64 characters, ASCII letters,
#: digits, ``_`` and ``-``, starting with a letter or digit (no ``.``, ``/``, ``\\``, NUL or spaces:
#: nothing a path could be traversed with)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
NAME_PATTERN = "^" + NAME.pattern + "$"
MAX_NAME = 64


def check_name(value: object, what: str = "memory id") -> str:
    """``value`` if it is a valid name (:data:`NAME`), else an error naming it and the rule.

    Raises:
        OptionError: not a string, empty, longer than 64 characters, or a character outside
            ``[A-Za-z0-9_-]`` (or a leading ``_`` / ``-``).
    """
    if not isinstance(value, str) or NAME.fullmatch(value) is None:
        shown = value[:80] if isinstance(value, str) else value
        raise OptionError(
            what,
            shown,
            f"use 1-{MAX_NAME} characters from A-Z, a-z, 0-9, '_' and '-', starting with a letter or digit.",
        )
    return value


#: the memory of an agent that names none (mem0's scopes without ``agent_id``)
DEFAULT_MEMORY = "default"
#: what joins an agent's id and a run's id into one memory id (never inside either: see :func:`scope`)
RUN_SEPARATOR = "--"


def scope(user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> tuple[str, str]:
    """mem0's scopes as eventkv's ``(namespace, memory id)``: the namespace is ``user_id``
    (:data:`DEFAULT_NAMESPACE` when None), the memory id is ``agent_id`` (:data:`DEFAULT_MEMORY`
    when None), followed by ``--run_id`` when a run is given. So a user's agents are memories of one
    namespace, which no other user's token reaches, and each run of an agent is a memory of its own.

    ``scope("alice", "travel", "r7") == ("alice", "travel--r7")``; ``scope("alice") == ("alice", "default")``.

    Raises:
        OptionError: a scope that is not a name (:func:`check_name`), an ``agent_id`` or ``run_id``
            holding ``--`` (the joined id would be ambiguous), or a joined id over 64 characters.
    """
    namespace = DEFAULT_NAMESPACE if user_id is None else check_name(user_id, "user_id")
    agent = DEFAULT_MEMORY if agent_id is None else check_name(agent_id, "agent_id")
    if run_id is None:
        return namespace, agent
    run = check_name(run_id, "run_id")
    for what, value in (("agent_id", agent), ("run_id", run)):
        if RUN_SEPARATOR in value:
            raise OptionError(
                what, value, f"give an id without {RUN_SEPARATOR!r} (it joins agent_id and run_id into a memory id)."
            )
    joined = f"{agent}{RUN_SEPARATOR}{run}"
    if len(joined) > MAX_NAME:
        raise OptionError(
            "run_id",
            run,
            f"agent_id and run_id joined ({joined[:80]!r}) are over {MAX_NAME} characters: give shorter ids.",
        )
    return namespace, joined


class Unauthorized(EventKVError):
    """No bearer token, or a wrong one (HTTP 401 ``unauthorized``)."""


class Forbidden(EventKVError):
    """The token is not granted the request's namespace, or a body names another namespace than the
    request's (HTTP 403 ``forbidden``)."""


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


class ReplicaUnavailable(EventKVError):
    """The Ray Serve replica answering the request stopped before its answer (killed, or its node
    lost): a write may or may not have been carried out, so read the memory (its version, its
    events) before sending it again (HTTP 503 ``unavailable`` + Retry-After)."""


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
    "locked": (503, StoreLocked),
    "unavailable": (503, ReplicaUnavailable),
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

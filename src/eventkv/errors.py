"""The one exception type eventkv raises for user errors, and its subclass for a bad option value."""


class EventKVError(Exception):
    """A user-facing error: bad input, a missing or corrupted model cache, an impossible request.

    The message always names the bad value and says how to fix it. The CLI prints it
    without a traceback and exits with code 2.
    """


class StoreDamaged(EventKVError):
    """A memory store whose files fail their checks: a SQLite file that does not open or read, rows,
    text or token ids whose checksum does not match, a record that does not parse. Only that memory
    is refused (the service answers HTTP 409 with code ``damaged``); every other memory keeps working.
    The message names the memory and the damaged part, and says how to recover (restore the store
    from a backup, or delete it and add its events again).
    """


class OutOfSpace(EventKVError):
    """A write refused because its filesystem is full or over quota (``ENOSPC``/``EDQUOT``). Nothing
    of the write was kept: the store is as it was before the call (the service answers HTTP 507 with
    code ``insufficient_storage``), and the same write succeeds once space is freed.
    """


class PurgePending(EventKVError):
    """A ``forget`` that is done logically but whose bytes are not yet erased from the store's files.

    The event is forgotten: its text, token ids and rows are no longer stored in any committed
    state, never served and never returned, and the id stays reserved. But the old bytes are still
    in ``memory.sqlite-wal`` (or in database pages a reader's snapshot still needs), because another
    connection held a read snapshot past the purge deadline, or the filesystem was too full to
    checkpoint. The purge is completed by calling ``forget`` on the same id again, by closing the
    memory, or by the next open; the message says which reader or condition blocked it.
    """


class StoreLocked(EventKVError):
    """A memory store whose writer lock another EventMemory holds (in this or another process: a
    store has one writer at a time). Nothing was read or written; the same call succeeds once the
    holder closes the store. The service answers HTTP 503 with code ``locked`` and Retry-After; the
    Ray Serve backend retries it against the replica that holds the store.
    """


class NotFound(EventKVError):
    """An unknown memory, event or route: a memory asked for an event id it never had (the service
    answers HTTP 404 ``not_found``)."""


class Conflict(EventKVError):
    """A request the memory's state refuses: nothing to serve (no live events), a write whose
    ``expected_version`` is behind the memory, a memory id or event id already taken (the service
    answers HTTP 409 ``conflict``)."""


class Gone(EventKVError):
    """The event was deleted or forgotten and the verb needs a live one, e.g. a forgotten event in an
    explicit served set, which has no rows (the service answers HTTP 410 ``gone``)."""


class OptionError(EventKVError):
    """A bad option value. ``str()`` names the library field (``max_new_tokens 0: generate at
    least 1 token.``); :meth:`for_cli` names the command-line flag instead (``--max-new-tokens 0:
    ...``), which is what the CLI prints.

    Attributes:
        field: the option's field name (``max_new_tokens``).
        value: the bad value as given.
        allowed: what is allowed, as a sentence (also says how to fix it).
        flag: the flag that sets the field (default ``--`` + the field with dashes).
    """

    def __init__(self, field: str, value, allowed: str, flag: str | None = None) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        self.flag = flag or "--" + field.replace("_", "-")
        super().__init__(f"{field} {show_value(value)}: {allowed}")

    def for_cli(self) -> str:
        return f"{self.flag} {show_value(self.value)}: {self.allowed}"


def show_value(value) -> str:
    """An option value as a user would type it: strings quoted, lists comma-joined; an int of more
    than 1000 bits by its size (``str`` refuses ints past 4300 digits, ``sys.get_int_max_str_digits``)."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        return f"({'a negative' if value < 0 else 'an'} integer of {value.bit_length()} bits)"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else "''"
    return str(value)


def cli_message(exc: EventKVError) -> str:
    """The one line the CLI prints for ``exc`` (an OptionError names its flag)."""
    return exc.for_cli() if isinstance(exc, OptionError) else str(exc)

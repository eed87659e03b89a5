"""The one exception type eventkv raises for user errors."""


class EventKVError(Exception):
    """A user-facing error: bad input, a missing or corrupted model cache, an impossible request.

    The message always names the bad value and says how to fix it. The CLI prints it
    without a traceback and exits with code 2.
    """

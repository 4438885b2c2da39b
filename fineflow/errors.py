"""Errors a user can act on.

Every error that reaches a user is a ``FineflowError`` whose message names the file (and line/row/field,
or the params key) and says what to change. Stage entries print the message and exit 2 instead of showing
a traceback from deep inside a library.
"""


class FineflowError(Exception):
    """A problem the user can fix; the message is the whole story."""


class ConfigError(FineflowError):
    """params.yaml is invalid; the message lists every problem at once."""


class DataError(FineflowError):
    """Input data is unreadable or fails a blocking check; the message names file:line and field."""

"""User-facing errors: the CLI prints their message (no traceback) and exits non-zero."""


class RecurfitError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""

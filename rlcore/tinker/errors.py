"""The one error a client's request can cause (`UserError`): the server answers it with one line, as a
failed request of category "user", and goes on serving."""

from __future__ import annotations


class UserError(ValueError):
    """A request the server cannot run as sent (an unknown loss, a malformed datum, a model that does not
    exist): its message names the culprit and the fix, in one line."""

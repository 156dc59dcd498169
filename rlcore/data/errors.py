"""The data layer's user error."""


class DataError(ValueError):
    """A data file or row that cannot be used; the message is one line naming file, row and field."""

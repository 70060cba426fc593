"""The one exception type for bad data inputs, so entry points can report it as a one-line error."""


class DataError(ValueError):
    """A data source, tokenizer or loader state that cannot be used; the message names the field or file."""

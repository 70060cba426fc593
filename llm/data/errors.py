"""The one exception type for bad data inputs, so entry points can report it as a one-line error, and the warning
type of the data pipeline (printed as one line by the command lines)."""

from llm.errors import IsollmWarning


class DataError(ValueError):
    """A data source, tokenizer or loader state that cannot be used; the message names the field or file."""


class DataWarning(IsollmWarning):
    """Data that was used anyway: a cache rebuilt or not written, a read retried, files skipped."""

"""The exception type for unusable evaluation inputs, so ``eval.py`` can report them as one-line errors
while any other exception (a bug) keeps its traceback."""


class EvalError(ValueError):
    """A run directory, metrics file, model or task that cannot be evaluated; the message names it."""

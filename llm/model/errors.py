"""The model's configuration error, apart from the config so that the variant modules can raise it: the
config resolves their registries, so they must not import it (one-way dependencies inside llm/model).

Copied to the hub with the modelling code: imports nothing.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; ``str(err)`` is ``"<field>: <what was expected>"``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def prefixed(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.field}", self.message)


def check_choice(field: str, value: str, choices: object) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of ``choices`` (a registry dict or a sequence)."""
    names = list(choices)
    if value not in names:
        raise ConfigError(field, f"unknown value {value!r}; expected one of: {', '.join(map(str, names))}")

"""The command-line tools, one module each, installed as ``[project.scripts]`` (pyproject.toml; the list:
docs/ARCHITECTURE.md). Each module's ``main(argv) -> int`` is what the tests call; exit codes are in each module's
docstring.
"""

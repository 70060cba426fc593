"""The suite's order (tests/tiny.py ``longest_first``, which tests/conftest.py's ``pytest_collection_modifyitems``
applies): the longest tests first, then the other slow ones, then the rest, each group in collection order, so that
xdist's two workers end together."""

from __future__ import annotations

from dataclasses import dataclass

from tiny import longest_first


@dataclass
class Item:
    """What the hook reads of a collected test: its node id and whether it is marked ``slow``."""

    nodeid: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_the_longest_tests_start_first_then_the_slow_ones_then_the_rest() -> None:
    items = [
        Item("tests/bench/test_a.py::test_fast"),
        Item("tests/launch/test_gpu_check.py::test_dry_run[a]", True),
        Item("tests/launch/test_gpu_check.py::test_fast"),
        Item("tests/data/test_b.py::test_slow", True),
        Item("tests/launch/test_gpu_check.py::test_dry_run[b]", True),
        Item("tests/test_readme.py::test_every_command", True),
        Item("tests/train/test_c.py::test_fast"),
    ]
    longest_first(items)
    assert [item.nodeid for item in items] == [
        "tests/test_readme.py::test_every_command",
        "tests/launch/test_gpu_check.py::test_dry_run[a]",
        "tests/launch/test_gpu_check.py::test_dry_run[b]",
        "tests/data/test_b.py::test_slow",
        "tests/bench/test_a.py::test_fast",
        "tests/launch/test_gpu_check.py::test_fast",
        "tests/train/test_c.py::test_fast",
    ]

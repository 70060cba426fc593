"""The bench scripts import their siblings (bench/paired.py, bench/step_rows.py) as top-level modules, as
``python bench/<script>.py`` runs them: the bench tests import them the same way."""

from __future__ import annotations

import sys

from tiny import REPO

sys.path.insert(0, str(REPO / "bench"))

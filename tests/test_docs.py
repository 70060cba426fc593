"""The docs hold together: every relative link of README.md and docs/ names a file that exists and, with an anchor, a
heading of it; and the figures docs/training.md quotes for the size presets (``param_counts``) and
docs/comparison.md for choosing the number of seeds (``llm.eval.stats``) are the code's.
The docs' commands run in tests/test_readme.py; the worked seed plan is checked in
tests/eval/test_docs_worked_plan.py, the simulation's Type I error and power in
tests/eval/test_compare_plan_simulation.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny import REPO

from llm.config import load_config
from llm.eval.stats import minimum_detectable_effect, seeds_needed
from llm.model import param_counts

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but - and _ dropped, spaces as -, a
    repeated heading numbered -1, -2, ..."""
    found, repeats = set(), {}
    for heading in re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The page's relative links (outside code blocks) to a file that does not exist or a heading it does not have."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: (not checked: no network)
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## How many seeds?\n\n## `eval.py` runs\n\n## Runs\n\n## Runs\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[a](other.md#how-many-seeds) [b](other.md#no-such) [c](missing.md) [d](#page) "
                    "[e](#nowhere) [f](https://example.com/x#y) [g](other.md#evalpy-runs) [h](other.md#runs-1)\n"
                    "```\n[i](inside-a-fence.md)\n```\n")
    assert broken_links(page) == ["other.md#no-such: no heading #no-such in other.md", "missing.md: no such file",
                                  "#nowhere: no heading #nowhere in page.md"]


SIZE_ROW = re.compile(r"^\| `([\w-]+)` \| ([\d,]+) \| ([\d,]+) \| (\d+) \| (\d+) \| (\d+) / (\d+) \| ([\d,]+) \|$",
                      re.MULTILINE)


def test_the_size_table_quotes_the_presets_counts() -> None:
    rows = SIZE_ROW.findall((REPO / "docs" / "training.md").read_text())
    assert sorted(name for name, *_ in rows) == sorted(p.stem for p in (REPO / "configs" / "sizes").glob("*.yaml"))
    for name, *cells in rows:
        model = load_config([str(REPO / "configs" / "sizes" / f"{name}.yaml")], ["train.max_steps=1"]).model
        counts = [f"{n:,}" for n in param_counts(model)]
        shape = [model.num_hidden_layers, model.hidden_size, model.num_attention_heads, model.num_key_value_heads]
        assert cells == [*counts, *map(str, shape), f"{model.vocab_size:,}"], name


def test_the_seed_counts_of_choosing_the_number_of_seeds_are_the_codes() -> None:
    """docs/comparison.md, "Choosing the number of seeds": the gap n seeds per arm resolve in units of a spread s
    common to both rows (``minimum_detectable_effect``), and the seeds per arm some gaps need (``seeds_needed``)."""
    page = " ".join((REPO / "docs" / "comparison.md").read_text().split())
    mde = {n: minimum_detectable_effect(1.0, n, 1.0, n) for n in (2, 3, 4, 5, 10, 20, 50)}
    assert (f"gaps of about {mde[2]:.1f} s at n = 2, {mde[3]:.1f} s at 3, {mde[4]:.1f} s at 4, {mde[5]:.1f} s at 5, "
            f"{mde[10]:.1f} s at 10, {mde[20]:.1f} s at 20 and {mde[50]:.2f} s at 50") in page
    by_d = [f"{seeds_needed(d, 1.0, 1.0):.0f}" for d in (0.5, 1.0, 2.0)]
    assert f"needs {by_d[0]} seeds per arm at d = 0.5, {by_d[1]} at d = 1 and {by_d[2]} at d = 2" in page
    tuned = [f"{seeds_needed(gap, s, s):.0f}" for s in (0.04, 0.01) for gap in (0.021, 0.009)]
    assert (f"at 0.04 a gap of 0.021 needs {tuned[0]} seeds per arm and 0.009 needs {tuned[1]}, at 0.01 they need "
            f"{tuned[2]} and {tuned[3]}") in page

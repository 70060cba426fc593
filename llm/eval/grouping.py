"""Which runs of a comparison are seeds of one row, which rows are one model at several sizes, and which rows the
baseline names.

Runs are grouped by their whole configuration except the seed: the ``model``, ``data`` and ``train`` sections of
the meta row's ``config`` (less the bookkeeping of ``llm.eval.runs.RESULT_NEUTRAL``) must be identical for two
runs to share a row, so an ablation (``iso_ln[layernorm=false]``), a run with another learning rate or one without
document masking is never pooled with its parent. The sections are compared as ``llm.eval.runs.RunRecord.setup``
gives them: a field added since a run was written is ``not recorded`` there (never today's default, which the run
may not have used), and a field changed on resume holds its values in order. A row is labelled by its variant name
(today's name for that configuration), which carries every non-default variant option; rows whose variant names
coincide but whose configurations differ are labelled with the fields that tell them apart, e.g.
``swiglu+softmax (train.lr=0.001)``, and a row of runs whose config changed on resume always with the change, e.g.
``swiglu+softmax (train.lr=0.003 -> 0.03@5)`` (the value from step 5: runs changed at another step are another
row). Labels can be long; the table prints a short key of each row whose label is more than its variant name
(``series_key``), which ``--baseline`` accepts.

A model size is a row's values of ``SIZE_KEYS`` (width and depth; the parameter counts follow from them). Rows that
differ only there are one *series*, one variant at several sizes (``llm.eval.scaling``), labelled as rows are but
with the size keys left out of the grouping; each row is compared with the baseline series' row of its size.

Two rows are compared (given a gap, a p-value, a plan) only where their seeds mean the same thing
(``incomparable``, the one predicate the table, the paired test, ``--plan`` and ``--planned`` use): every compared
field outside the sections a comparison varies (``TREATMENTS``) is equal, the seed scope included, but for the
fields ``SEED_MEANING_EXEMPT`` names, and so is the world size. An integer ``data.seed`` fixes one data order for
every seed of a row, whose effect no number of seeds averages out: a row on another order, or of the ``run`` scope
(one order per seed), against it would test that order's effect with the variant's. A row of another meaning is
listed with the reason; where the baseline comes in several (one row per seed scope), each row is compared with the
one of its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from llm.eval.errors import EvalError
from llm.eval.runs import NOT_RECORDED, RunRecord

__all__ = ["SEED_MEANING_EXEMPT", "SIZE_KEYS", "TREATMENTS", "group_runs", "incomparable", "model_size",
           "resolve_baseline", "seed_meaning", "series_key", "series_labels"]

# The config keys of a model's size. ``ffn_param_match`` shrinks a wider FFN inside the model, not in the config,
# so the rows of every variant at one size share these values.
SIZE_KEYS = ("model.hidden_size", "model.intermediate_size", "model.num_hidden_layers",
             "model.num_attention_heads", "model.num_key_value_heads", "model.head_dim")

Rows = Mapping[str, Sequence[RunRecord]]

# The sections in which a row differs from its baseline by design: the model and the training recipe (a learning
# rate tuned per variant, say). Every other compared field (a new one too) sets what a seed means.
TREATMENTS = ("model.", "train.")
SEED_MEANING_EXEMPT = {
    "data.document_masking": "which tokens a position attends to, not which tokens a seed draws: a treatment",
    "data.tokenize_batch": "how many documents are tokenized at once: not one token changes",
}
"""Fields outside ``TREATMENTS`` that change neither which tokens a seed draws nor the validation split, with why."""


def seed_meaning(run: RunRecord) -> dict[str, Any]:
    """What a seed of ``run`` means: its seed scope, every compared field outside ``TREATMENTS`` (its data and the
    data's fingerprints) but ``SEED_MEANING_EXEMPT``, and its world size (ranks x workers deal the data out)."""
    return {"seed scope": "run" if run.setup.get("data.seed") == "run" else "init",
            **{key: value for key, value in run.setup.items()
               if not key.startswith(TREATMENTS) and key not in SEED_MEANING_EXEMPT},
            "world size": run.meta.get("world_size")}


def incomparable(runs: Sequence[RunRecord], baseline: Sequence[RunRecord]) -> str:
    """Why the seeds of a row (``runs``) and those of ``baseline`` mean different things (``seed_meaning``), each
    field that differs with its values in the row and in the baseline; empty when every seed of both means one."""
    mine, theirs = ([seed_meaning(run) for run in group] for group in (runs, baseline))
    differing = [key for key in {key: None for meaning in [*mine, *theirs] for key in meaning}
                 if len({json.dumps(meaning.get(key)) for meaning in [*mine, *theirs]}) > 1]
    return "; ".join(f"{key} {'/'.join(sorted({str(m.get(key)) for m in mine}))}, its baseline's "
                     f"{'/'.join(sorted({str(m.get(key)) for m in theirs}))}" for key in differing)


def model_size(run: RunRecord) -> tuple[Any, ...]:
    """The run's values of ``SIZE_KEYS``."""
    return tuple(run.setup[key] for key in SIZE_KEYS)


def series_key(run: RunRecord, tune: Sequence[str] = ()) -> str:
    """A short name of the series of ``run``'s row: a digest of its compared config less ``SIZE_KEYS`` and the
    tuned keys, the same in every comparison."""
    setup = {k: v for k, v in run.setup.items() if k not in {*tune, *SIZE_KEYS}}
    return hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:6]


def group_runs(runs: Sequence[RunRecord], ignore: Sequence[str] = ()) -> dict[str, list[RunRecord]]:
    """Rows of the comparison: runs whose ``model``/``data``/``train`` sections are identical but for the keys in
    ``ignore`` (``--tune`` keys), each labelled by its variant name, plus ``(field=value, ...)`` for the fields that
    differ between rows with the same variant name and those that changed on resume. Sorted by label; members
    sorted by seed."""
    by_setup: dict[str, list[RunRecord]] = {}
    for run in runs:
        setup = {k: v for k, v in run.setup.items() if k not in ignore}
        by_setup.setdefault(json.dumps(setup, sort_keys=True), []).append(run)
    same_name: dict[str, list[str]] = {}
    for key, members in by_setup.items():
        same_name.setdefault(members[0].variant, []).append(key)
    rows: dict[str, list[RunRecord]] = {}
    for variant, keys in same_name.items():
        setups = [json.loads(key) for key in keys]
        fields_ = sorted(set().union(*setups))
        differing = [f for f in fields_ if len({json.dumps(s.get(f)) for s in setups}) > 1]
        for key, setup in zip(keys, setups, strict=True):
            shown = sorted({*differing, *(f for f in by_setup[key][0].changed if f in setup)})
            label = f"{variant} ({', '.join(f'{f}={setup.get(f)}' for f in shown)})" if shown else variant
            rows[label] = sorted(by_setup[key], key=lambda r: r.seed)
    return dict(sorted(rows.items()))


def series_labels(rows: Rows, tune: Sequence[str] = ()) -> dict[str, str]:
    """Row label -> the label of its series: the rows whose configurations differ only in ``SIZE_KEYS`` (and the
    tuned keys), labelled as ``group_runs`` labels rows. With one size, a row's series label is its own."""
    first = {id(members[0]): label for label, members in rows.items()}
    series = group_runs([members[0] for members in rows.values()], (*tune, *SIZE_KEYS))
    return {first[id(run)]: name for name, members in series.items() for run in members}


def resolve_baseline(rows: Rows, baseline: str, series: Mapping[str, str], tune: Sequence[str] = ()) -> list[str]:
    """The labels of the rows ``baseline`` names: one row label, or the rows (one per size) of the one series that
    ``baseline`` names by its label, its variant name, its FFN name alone (``swiglu`` when one scoring is present)
    or its key (``series_key``); where those rows come in several seed meanings (``seed_meaning``: both seed scopes,
    say), the one series of each, so that each row is compared with the baseline whose seeds mean what its own
    do. Empty when it names no row; an EvalError listing the series and their keys when it
    names rows of several (any choice among them would be a guess), suggesting ``--tune`` only where they differ
    in one key that is a choice to tune: not the data, the run's length, or a value changed on resume."""
    if baseline in rows:
        return [baseline]
    for name_of in (lambda label: series[label], lambda label: rows[label][0].variant,
                    lambda label: rows[label][0].variant.split("+")[0], lambda label: series_key(rows[label][0], tune)):
        matches = [label for label in rows if name_of(label) == baseline]
        kinds = {(json.dumps(seed_meaning(rows[label][0]), sort_keys=True), series[label]) for label in matches}
        if matches and len(kinds) == len({meaning for meaning, _ in kinds}):  # one series per seed meaning
            return matches
        if matches:
            named = [f"{name!r} [{key}]" for name, key in sorted({(series[label], series_key(rows[label][0], tune))
                                                                   for label in matches})]
            runs = [rows[label][0] for label in matches]
            differing = sorted({key for run in runs for key in run.setup if run.setup[key] != runs[0].setup.get(key)})
            tunable = len(differing) == 1 and not differing[0].startswith(("data", "train.max_")) and all(
                differing[0] not in run.changed and run.setup[differing[0]] != NOT_RECORDED for run in runs)
            tune_ = f", or --tune {differing[0]} for each variant at its best value" if tunable else ""
            raise EvalError(f"baseline {baseline} names {len(named)} rows ({', '.join(named)}); pass one of these "
                            f"labels or keys as --baseline{tune_}")
    return []

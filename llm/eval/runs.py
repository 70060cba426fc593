"""Reading a run directory's ``metrics.jsonl`` for a comparison: what every caller of a finished (or broken) run
reads, compare, the model card and the GPU check alike.

A run leaves its file damaged in known ways: a line cut off by a kill or a full disk, an empty file, a diverged
run whose last validation loss is NaN, a run stopped before its last eval. None of them stops a comparison:
a line that does not parse is skipped with a warning naming the file and line, and each run has a status
(``RunRecord.status``: complete, diverged or incomplete), so the table keeps only complete runs in its statistics
and lists the others.

A line that parses but cannot be a row (a step that is no integer, an eval row without its token count, a loss
that is missing, null, negative or beyond float32's range, the widest the trainer computes in) is damaged too, and
skipped so. A NaN or infinite loss is a diverged run's, and kept; so is a final loss above uniform prediction's.

A run is read by the history that produced its final weights: each start (the first and every resume) appends a
meta row with the config and ``max_steps`` in force at its step, so the file is a sequence of segments. Resuming
from an earlier checkpoint (a rollback) truncates the train and eval rows past it but keeps every meta row: a
segment that a later one starts at or before was undone, and is not part of the history. Nor is a resume at or
past its end (``max_steps``, or for an older writer's meta row that lacks it, its own config's end), which trained
nothing. The run's identity in a comparison is the sequence of (first step, compared config) of the remaining
segments (``RunRecord.segments``); its seed is its first segment's (a seed cannot change mid-run: the data order
comes from the checkpoint). The run's end is the last segment's, its final value the eval there, and a run whose
last segment stopped short of it is incomplete, whatever an earlier segment reached. A field whose value changed
on resume holds its values in order, each later one with the step it took effect at (``RunRecord.setup``:
``0.003 -> 0.03@5``), so the run is a row of its own labelled with the change (``llm.eval.grouping``), never pooled
with runs that ran one configuration or changed it at another step. A field missing from a segment's saved config
(written before the field existed) is ``NOT_RECORDED``, never today's default; only the model section is first
read as the model reads an old config (``upgrade_saved``: the values an old checkpoint provably computes with).
"""

from __future__ import annotations

import glob
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import groupby
from pathlib import Path
from typing import Any

from transformers.utils import flatten_dict

from llm.config import ConfigError, RunConfig, read_saved
from llm.eval.errors import EvalError
from llm.model.config import upgrade_saved

__all__ = ["COMPARED_SECTIONS", "NOT_RECORDED", "RESULT_NEUTRAL", "SPIKE_FACTOR", "SPIKE_WINDOW", "RunRecord",
           "expand_run_dirs", "load_run", "read_metrics", "step_rows"]

# Config sections two runs must share (every field but ``RESULT_NEUTRAL``) to be seeds of one row.
COMPARED_SECTIONS = ("model", "data", "train")
# Fields that cannot change a run's numbers, so that seeds differing only there are one row: bookkeeping, the
# chunk length of iso_tanh's chunked form (its forms agree up to rounding) and recomputing activations (bit-identical
# gradients). ``data.num_workers`` is not among them: ranks x workers sets the data order.
RESULT_NEUTRAL = frozenset({"data.cache_dir", "data.read_retries", "data.retry_backoff_s", "train.log_every",
                            "train.checkpoint_every", "train.keep_checkpoints", "model.iso_tanh_chunk_size",
                            "train.activation_checkpointing", "train.collective_timeout_s", "train.stop_grace_s"})

# What a meta row's ``data_fingerprints`` records, and the config fields that only say where that data is read from.
DATA_FINGERPRINTS = ("tokenizer", "prepared", "source")
DATA_PATHS = ("data.source", "data.tokenizer", "data.prepared")

# The value of a config field a run's saved config lacks (its code predates the field).
NOT_RECORDED = "not recorded"

# A logged pre-clip gradient norm ``SPIKE_FACTOR`` times the median of the ``SPIKE_WINDOW`` norms logged before
# it is a spike (``RunRecord.grad_norm_spike``). In the tuned replication (docs/results/replicate-cpu-tuned) the
# runs with no visible instability peak at 1.4-8x and the spikes its README names (93-449) at 50-390x.
SPIKE_FACTOR = 10.0
SPIKE_WINDOW = 10

# The loss each row kind carries, and the largest one the trainer can log (it computes in float32 at most).
LOSS_KEYS = {"train": "loss", "eval": "val_loss"}
FLOAT32_MAX = 3.4028234663852886e38
TEXT_FIELDS = frozenset({"kind", "peak_mem_kind", "layers"})
"""The fields of a train or eval row that are not numbers (``layers``: the per-layer report, a list)."""


def _damage(row: Any) -> str | None:
    """Why a parsed metrics line is no row compare can read (module docstring); None when it is one."""
    if not isinstance(row, dict) or "kind" not in row or not isinstance(row.get("step"), int):
        return "a line that is not a metrics row (cut off or damaged)"
    loss = row.get(key := LOSS_KEYS.get(row["kind"], ""))
    if key and not (type(loss) in (int, float) and (not math.isfinite(loss) or 0 <= loss <= FLOAT32_MAX)):
        shown = json.dumps(loss) if key in row else "missing"
        return f"a {row['kind']} row whose {key} is {shown}, not a loss (damaged)"
    if row["kind"] == "eval" and type(row.get("tokens")) is not int:
        return "an eval row without its token count (damaged)"
    # every other field of a train or eval row is a number the trainer wrote (or null), but these
    if key and (bad := next((k for k, v in row.items() if k not in TEXT_FIELDS and v is not None
                             and type(v) not in (int, float)), None)):
        return f"a {row['kind']} row whose {bad} is {json.dumps(row[bad])}, not a number (damaged)"
    layers = row.get("layers", [])
    return None if isinstance(layers, list) and all(isinstance(entry, dict) for entry in layers) else \
        f"a {row['kind']} row whose layers are {json.dumps(layers)[:40]}, not a list of layer reports (damaged)"


def read_metrics(run_dir: str | Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (FileNotFoundError when there is none). A line that is not a JSON
    object (cut off by a kill or a full disk) or not a readable row (``_damage``) is skipped, and named by file and
    line number in ``problems`` when given."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: no metrics.jsonl (not a run directory)")
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if (problem := _damage(row)) is None:
            rows.append(row)
        elif problems is not None:
            problems.append(f"{path}:{lineno}: skipped {problem}")
    return rows


def step_rows(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The ``kind`` rows ("train", "eval"), one per step in step order: after a resume, a re-logged step supersedes."""
    by_step = {int(r["step"]): r for r in rows if r.get("kind") == kind}
    return [by_step[s] for s in sorted(by_step)]


@dataclass
class RunRecord:
    """The rows of one run's ``metrics.jsonl``, deduplicated by step (a resumed run re-logs steps)."""

    path: Path
    meta: dict[str, Any]
    """The last segment's meta row (module docstring)."""
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    config: RunConfig
    """The last segment's ``model``, ``data`` and ``train`` sections as today's code reads them back
    (``llm.config.read_saved``); the other fields, and those it did not record, are today's defaults."""
    segments: list[tuple[int, dict[str, Any]]]
    """Each segment's first step and its compared config fields (dotted keys, less ``RESULT_NEUTRAL``, a field
    it did not record ``NOT_RECORDED``) with its data's fingerprints (``data_fingerprint.tokenizer``,
    ``data_fingerprint.prepared`` and ``data_fingerprint.source``, from its meta row; where the source's is
    recorded, the ``DATA_PATHS`` are left out: the same data through another path is the same data), in order."""
    seed: int
    """The first segment's seed; the segments are those that produced its final weights (module docstring)."""
    problems: list[str] = field(default_factory=list)
    """Damaged lines of its metrics file, each named by file and line."""

    @property
    def variant(self) -> str:
        """Today's variant name of the run's model (a run written with older option defaults may have
        logged another name for the same configuration)."""
        return self.config.model.variant_name

    @cached_property
    def changed(self) -> dict[str, list[tuple[int, Any]]]:
        """The compared config fields whose value changed on a resume -> (first step, value) of each value in
        order."""
        history = {key: [next(run) for _, run in groupby(((step, setup[key]) for step, setup in self.segments),
                                                         key=lambda step_value: step_value[1])]
                   for key in self.segments[-1][1]}
        return {key: values for key, values in history.items() if len(values) > 1}

    @cached_property
    def setup(self) -> dict[str, Any]:
        """What grouping compares: the last segment's config fields, a field that changed on resume as its values
        in order, each later one at the step it took effect (``0.003 -> 0.03@5``). Computed once: grouping reads
        it for every run and every row."""
        changed = {key: str(values[0][1]) + "".join(f" -> {value}@{step}" for step, value in values[1:])
                   for key, values in self.changed.items()}
        return {**self.segments[-1][1], **changed}

    @property
    def final_val_loss(self) -> float:
        """The last eval's validation loss (NaN when the run never evaluated)."""
        return float(self.evals[-1]["val_loss"]) if self.evals else math.nan

    @property
    def final_tokens(self) -> int:
        return int(self.evals[-1]["tokens"]) if self.evals else 0

    @property
    def last_step(self) -> int:
        """The step the run was to end at: its last segment's end (``_end_step``)."""
        return _end_step(self.meta, self.config)

    @property
    def diverged(self) -> bool:
        """Its last validation loss is not finite or above uniform prediction's (ln of the vocabulary size: a model
        worse than knowing nothing has learnt nothing), or it ended early after a step whose loss was not finite."""
        if self.evals and not self.final_val_loss <= math.log(self.config.model.vocab_size):
            return True
        ended_early = not self.evals or self.evals[-1]["step"] < self.last_step
        return ended_early and bool(self.train) and not math.isfinite(float(self.train[-1].get("loss", 0.0)))

    @property
    def complete(self) -> bool:
        """Evaluated at its last step, with a finite loss: the only runs a row's statistics use."""
        return bool(self.evals) and self.evals[-1]["step"] >= self.last_step and not self.diverged

    @property
    def status(self) -> str:
        """complete | diverged | incomplete (ended before its last eval: killed, or its file cut off)."""
        return "complete" if self.complete else "diverged" if self.diverged else "incomplete"

    @property
    def stability(self) -> float:
        """``grad_norm_var_run`` of the last train row: gradient-norm variance over the run after warmup."""
        value = self.train[-1].get("grad_norm_var_run") if self.train else None
        return math.nan if value is None else float(value)

    @property
    def grad_norm_spike(self) -> tuple[int, float, float] | None:
        """(step, pre-clip gradient norm, its multiple of the baseline) of the logged norm after warmup that most
        exceeds its baseline, the median of the ``SPIKE_WINDOW`` norms logged before it, when it does by
        ``SPIKE_FACTOR`` or more; None otherwise. The baseline is local because the norm falls as training goes
        on: right after warmup it is 10-20x its final value in runs with no instability."""
        logged = [(int(r["step"]), float(r["grad_norm"])) for r in self.train if r.get("grad_norm") is not None]
        worst: tuple[int, float, float] | None = None
        for i, (step, norm) in enumerate(logged):
            before = [n for _, n in logged[max(0, i - SPIKE_WINDOW):i] if math.isfinite(n)]
            if step <= self.config.train.warmup_steps or not before or not math.isfinite(norm):
                continue
            baseline = statistics.median(before)
            ratio = norm / baseline if baseline > 0 else math.nan
            if ratio >= SPIKE_FACTOR and (worst is None or ratio > worst[2]):
                worst = (step, norm, ratio)
        return worst

    @property
    def tokens_per_s(self) -> float:
        """Median over the train rows: robust to the slow first steps (compilation, warm caches)."""
        rates = [float(r["tokens_per_s"]) for r in self.train if r.get("tokens_per_s") is not None]
        return statistics.median(rates) if rates else math.nan


def _end_step(meta: dict[str, Any], config: RunConfig) -> int:
    """The step a segment was to end at: its meta row's ``max_steps``, else (a row logged before it had one) the
    end its config sets, as the trainer resolves it (``llm.train.setup.resolve_max_steps``)."""
    train = config.train
    return int(meta.get("max_steps") or train.max_steps or math.ceil(train.max_tokens / train.global_batch_tokens))


def _read_config(path: Path, meta: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """A meta row's config as today's code reads it back, and its compared fields (``RunRecord.segments``)."""
    config = meta.get("config")
    if not isinstance(config, dict) or not all(isinstance(config.get(s), dict) for s in COMPARED_SECTIONS):
        raise EvalError(f"{path}: the meta row has no 'config' with the {', '.join(COMPARED_SECTIONS)} "
                        f"sections (needed to tell which runs are seeds of one configuration)")
    try:
        read = read_saved({section: config[section] for section in COMPARED_SECTIONS})
    except ConfigError as err:
        raise EvalError(f"{path}: today's code cannot read back the meta row's config: {err}") from None
    recorded = flatten_dict({**config, "model": upgrade_saved(dict(config["model"]))})
    flat = flatten_dict({section: asdict(getattr(read, section)) for section in COMPARED_SECTIONS})
    # the data's identity beyond its settings (the tokenizer's, a prepared index's and the source files' content),
    # as the segment recorded; where the source's is recorded, the paths that reach the data are no part of it
    fingerprints = {**dict.fromkeys(DATA_FINGERPRINTS, NOT_RECORDED), **(meta.get("data_fingerprints") or {})}
    paths = DATA_PATHS if fingerprints["source"] != NOT_RECORDED else ()
    return read, {**{key: value if key in recorded else NOT_RECORDED for key, value in flat.items()
                     if key not in RESULT_NEUTRAL and key not in paths},
                  **{f"data_fingerprint.{data}": value for data, value in fingerprints.items()}}


def load_run(run_dir: str | Path) -> RunRecord:
    """Read ``run_dir/metrics.jsonl`` (``read_metrics``) for a comparison, by its segments (module docstring).
    FileNotFoundError / EvalError naming the file when there is nothing to compare: no meta row (an empty file),
    or a saved config section that today's code cannot read back (an unknown field, a value of the wrong type or
    one today's validation refuses). A run that never evaluated is read, and is ``incomplete``."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    problems: list[str] = []
    rows = read_metrics(run_dir, problems)
    metas = [r for r in rows if r.get("kind") == "meta"]
    if not metas:
        raise EvalError(f"{path}: no meta row (kind=meta) with the run's variant and seed"
                        f"{' (the file is empty)' if not rows and not problems else ''}")
    # Rolled back: a later start at or before a segment's own undid it. A resume at or past its end trained nothing.
    metas = [meta for i, meta in enumerate(metas) if all(meta["step"] < later["step"] for later in metas[i + 1:])]
    configs = [_read_config(path, meta) for meta in metas]
    kept = [0, *(i for i in range(1, len(metas)) if metas[i]["step"] < _end_step(metas[i], configs[i][0]))]
    return RunRecord(path=run_dir, meta=metas[kept[-1]], train=step_rows(rows, "train"),
                     evals=step_rows(rows, "eval"), config=configs[kept[-1]][0],
                     segments=[(metas[i]["step"], configs[i][1]) for i in kept], seed=int(metas[0].get("seed", 0)),
                     problems=problems)


def expand_run_dirs(patterns: Iterable[str]) -> list[Path]:
    """Run directories from paths and (quoted) glob patterns; a pattern matching nothing is an error.

    A pattern keeps only directories holding a ``metrics.jsonl`` (so ``runs/x-*`` may also match a
    log folder); a directory named explicitly is kept and fails later if it is not a run."""
    dirs: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            if not (matches := [Path(m) for m in sorted(glob.glob(pattern)) if (Path(m) / "metrics.jsonl").is_file()]):
                raise FileNotFoundError(f"{pattern}: the pattern matches no run directory")
            dirs.extend(matches)
        else:
            dirs.append(Path(pattern))
    if not dirs:
        raise EvalError("no run directories given")
    return dirs

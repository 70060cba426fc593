"""A resume continues only the data the run read: the source's files are fingerprinted by content (recorded in each
loader state and meta row), a source replaced at the same path is refused naming both fingerprints, and a state
written by older code is checked by what it carries (the checkpoint's tokenizer.json; the tokenization rule, known
only from states that record the tokenizer's fingerprint). Compare keeps runs of other data apart and runs of the
same data together, whatever path reached it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import fineweb_files, forget_sources, metrics_rows

from llm.cli.eval import main as eval_main
from llm.cli.train import main
from llm.data import train_tokenizer
from llm.eval.grouping import group_runs
from llm.eval.runs import load_run
from llm.train.checkpoint_files import MANIFEST, write_manifest

SAVE = ["train.max_steps=2", "train.checkpoint_every=2"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.fixture
def own_corpus(corpus: Path, tmp_path: Path) -> Path:
    """A copy of the corpus that a test may rewrite."""
    return Path(shutil.copytree(corpus, tmp_path / "corpus"))


def _replace_documents(corpus: Path) -> None:
    """The corpus' first file rewritten at the same path with other sample documents."""
    rows = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(300, 100).to_pylist()
    pq.write_table(pa.Table.from_pylist([{"text": r["text"][:600], "id": r["id"]} for r in rows]),
                   sorted(corpus.iterdir())[0])
    forget_sources()  # as the next run's new process


def _strip_state(checkpoint: Path, keys: tuple[str, ...]) -> None:
    """The checkpoint's loader state as older code wrote it (without ``keys``), its manifest rewritten to match."""
    path = checkpoint / "state" / "data_rank0.pt"
    state = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in state.items() if k not in keys}, path)
    (checkpoint / MANIFEST).unlink()
    write_manifest(checkpoint)


def test_a_streamed_source_replaced_at_the_same_path_is_refused(overrides_under, own_corpus: Path, tmp_path: Path,
                                                                capsys) -> None:
    """Before, the run resumed on the new documents without a word, its validation set changed mid-run."""
    args = [*overrides_under(tmp_path), f"data.source={own_corpus}", "name=r"]
    assert main([*args, *SAVE]) == 0
    recorded = metrics_rows(tmp_path / "runs" / "r", "meta")[0]["data_fingerprints"]["source"]
    _replace_documents(own_corpus)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    [line] = _error_lines(capsys.readouterr().err)
    was, now = re.fullmatch(r"error: data loader state: source_fingerprint was '(\w+)', this loader has '(\w+)'; "
                            r"resume with the same data settings and files", line).groups()
    assert was == recorded != now
    capsys.readouterr()  # eval.py evaluates it on the new files, and says so
    assert eval_main([str(tmp_path / "runs" / "r"), "--samples", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == [
        f"data.source {own_corpus} holds other files than the run trained on (source fingerprint {was} in its "
        f"checkpoint, {now} now): this is not the run's validation set"]


def test_older_loader_states_are_checked_by_what_they_carry(run_overrides: list[str], corpus: Path, tmp_path: Path,
                                                            capsys) -> None:
    """A state without a source fingerprint (written before it was recorded) resumes with one line and records it
    from then on; one without the tokenizer's fingerprint is of unknown tokenization and refused; a swapped tokenizer
    is refused by the checkpoint's tokenizer.json (before: each resumed silently)."""
    args = [*run_overrides, "name=o"]
    assert main([*args, *SAVE]) == 0
    run_dir = tmp_path / "runs" / "o"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    _strip_state(checkpoint, ("source_fingerprint", "tokenization"))
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"records no source fingerprint \(older isollm\): .* could not be checked "
                                         r"against it; recorded from this resume on"):
        assert main([*args, "train.max_steps=4", "train.checkpoint_every=4", "resume=true"]) == 0
    assert metrics_rows(run_dir, "meta")[-1]["data_fingerprints"]["source"] is not None

    checkpoint = run_dir / "checkpoints" / "step_00000004"
    _strip_state(checkpoint, ("source_fingerprint", "tokenization", "tokenizer_fingerprint", "prepared_fingerprint"))
    assert main([*args, "train.max_steps=6", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        "error: data loader state: written by an isollm that recorded neither the tokenizer nor the document "
        "tokenization, which has changed since (long documents, txt paragraphs): continuing would train on other "
        "tokens; start another run (name=) for this data"]
    other = train_tokenizer([str(sorted(corpus.iterdir())[0])], 512, tmp_path / "other.json")
    assert main([*args, f"data.tokenizer={tmp_path / 'other.json'}", "train.max_steps=6", "resume=true"]) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: data.tokenizer: checkpoint {checkpoint} was trained with another tokenizer")
    assert line.endswith(f"resume with the tokenizer it saves, {checkpoint / 'model' / 'tokenizer.json'}")
    assert other.get_vocab_size() == 512


def test_compare_keeps_rows_by_the_data_not_its_path(overrides_under, own_corpus: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same files by an absolute and a relative path are one row; other files at the same path another. Before,
    the path string told rows apart and nothing told the data apart."""
    args = [*overrides_under(tmp_path), "train.max_steps=1"]
    assert main([*args, f"data.source={own_corpus}", "name=a", "seed=1"]) == 0
    monkeypatch.chdir(tmp_path)
    assert main([*args, "data.source=corpus", "name=b", "seed=2"]) == 0
    _replace_documents(own_corpus)
    assert main([*args, f"data.source={own_corpus}", "name=c", "seed=3"]) == 0
    rows = group_runs([load_run(tmp_path / "runs" / name) for name in "abc"])
    assert sorted(sorted(run.seed for run in members) for members in rows.values()) == [[1, 2], [3]]


@pytest.mark.parametrize("pointer", ["step_00000002", "step_00000077"], ids=["older", "missing"])
def test_a_latest_pointer_at_an_older_or_missing_step_never_rolls_back(run_overrides: list[str], tmp_path: Path,
                                                                       pointer: str, capsys) -> None:
    """``latest`` pointed back at step 2 (or at a step that is not there) while steps 3 and 4 are complete: the
    resume says so and continues from step 4. Before, it went back to step 2 and overwrote steps 3 and 4 without a
    word (a missing step fell back to the newest in silence)."""
    args = [*run_overrides, "name=l", "train.checkpoint_every=1", "train.keep_checkpoints=9"]
    assert main([*args, "train.max_steps=4"]) == 0
    ckpts = tmp_path / "runs" / "l" / "checkpoints"
    newer = {p: p.read_bytes() for p in sorted((ckpts / "step_00000004").rglob("*")) if p.is_file()}
    (ckpts / "latest").write_text(f"{pointer}\n")
    capsys.readouterr()
    why = ("older than step_00000004: using the newest checkpoint that verifies, never overwriting newer ones "
           rf"\(to go back to step_00000002, move those out of {ckpts}\)" if pointer == "step_00000002" else
           r"which is not there: using the newest checkpoint that verifies \(step_00000004 first\)")
    with pytest.warns(UserWarning, match=f"^{ckpts / 'latest'} names {pointer}, {why}$"):
        assert main([*args, "train.max_steps=5", "resume=true"]) == 0
    assert f"resumed from {ckpts / 'step_00000004'} at step 4" in capsys.readouterr().out
    assert all(path.read_bytes() == data for path, data in newer.items())

"""FineWeb's own repository layout, offline: a local directory laid out like HuggingFaceFW/fineweb (its
README ``configs:`` block, ``sample/10BT/*.parquet``) resolves by config name through the code path a hub id
takes, and a hub id routed to it trains, validates and plans; plus ``isollm-data plan`` and ``prepare``."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from tiny import fineweb_files
from tokenizers import Tokenizer

from llm.cli.data import main
from llm.config import DataConfig
from llm.data.pieces import list_pieces
from llm.data.sources import resolve_source
from llm.data.stream import build_train_loader
from llm.data.tokenizer import eos_id
from llm.data.validation import build_val_windows

README = """---
license: odc-by
task_categories:
- text-generation
pretty_name: FineWeb
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
- config_name: CC-MAIN-2024-10
  data_files:
  - split: train
    path: data/CC-MAIN-2024-10/*
---
# FineWeb
"""


@pytest.fixture(scope="module")
def fineweb_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HuggingFaceFW/fineweb's layout: 3 sample-10BT files (120 sample documents, 2 row groups each) and a
    dump of another config that sample-10BT must not read."""
    root = tmp_path_factory.mktemp("fineweb")
    (root / "README.md").write_text(README)
    table = pq.read_table(fineweb_files()[0]).slice(0, 160)
    for k in range(3):
        path = root / "sample" / "10BT" / f"{k:03d}_00000.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(40 * k, 40), path, row_group_size=20)
    dump = root / "data" / "CC-MAIN-2024-10" / "000_00000.parquet"
    dump.parent.mkdir(parents=True)
    pq.write_table(table.slice(120, 40), dump)
    return root


def cfg_for(source: str, tmp_path: Path) -> DataConfig:
    return DataConfig(source=source, name="sample-10BT", seq_len=32, shuffle_block=4, val_bucket=20,
                      val_tokens=100, tokenize_batch=8, cache_dir=str(tmp_path / "cache"))


def test_config_name_selects_the_files(fineweb_repo: Path) -> None:
    source = resolve_source(str(fineweb_repo), "sample-10BT")
    assert not source.is_local and source.name == "sample-10BT"
    pieces = list_pieces(source)
    assert [Path(p.file).relative_to(fineweb_repo).as_posix() for p in pieces[::2]] == [
        f"sample/10BT/{k:03d}_00000.parquet" for k in range(3)]
    assert [p.group for p in pieces] == [0, 1] * 3 and sum(p.size for p in pieces) == 120
    dump = list_pieces(resolve_source(str(fineweb_repo), "CC-MAIN-2024-10"))
    assert [Path(p.file).parent.name for p in dump] == ["CC-MAIN-2024-10"]
    with pytest.raises(ValueError, match=r"^data.source: cannot resolve .* config 'sample-99BT' \(.*\)$"):
        list_pieces(resolve_source(str(fineweb_repo), "sample-99BT"))


def test_hub_id_takes_the_same_path(fineweb_repo: Path, tmp_path: Path, bpe: Tokenizer,
                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``HuggingFaceFW/fineweb`` with ``sample-10BT``, its repository served from the local copy: the
    training batches, validation windows and plan equal those of the local directory."""
    real = datasets.load_dataset_builder
    calls: list[tuple[str, str | None]] = []

    def offline(path: str, name: str | None = None, **kwargs):
        calls.append((path, name))
        return real(str(fineweb_repo) if path == "HuggingFaceFW/fineweb" else path, name, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset_builder", offline)
    hub, local = cfg_for("HuggingFaceFW/fineweb", tmp_path / "hub"), cfg_for(str(fineweb_repo), tmp_path)
    batches = [[b.tolist() for b, _ in zip(build_train_loader(cfg, bpe, 2, 1, 2), range(3), strict=False)]
               for cfg in (hub, local)]
    assert batches[0] == batches[1]
    assert build_val_windows(hub, bpe).tolist() == build_val_windows(local, bpe).tolist()
    assert ("HuggingFaceFW/fineweb", "sample-10BT") in calls
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    assert main(["plan", "HuggingFaceFW/fineweb", "--name", "sample-10BT", "--world-size", "2", "--workers", "2",
                 "--tokenizer", str(tok)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("HuggingFaceFW/fineweb config sample-10BT: 3 parquet file(s), 6 piece(s), 120 rows")
    assert [line.split()[3] for line in out[3:7]] == ["30"] * 4  # 120 documents over 4 nodes


def test_plan_shows_each_node_share(tmp_path: Path, bpe: Tokenizer, capsys: pytest.CaptureFixture[str]) -> None:
    """5 files of 99 rows in row groups of 25, 7 nodes: shares of 70 or 71 rows; amplification = whole row
    groups decoded over the share."""
    table = pq.read_table(fineweb_files()[0], columns=["text", "id"]).slice(0, 495)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(5):
        pq.write_table(table.slice(99 * k, 99), corpus / f"part-{k}.parquet", row_group_size=25)
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    assert main(["plan", str(corpus), "--world-size", "7", "--tokenizer", str(tok), "--sample-docs", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("parquet: 5 parquet file(s), 20 piece(s), 495 rows")
    rows = [line.split() for line in out[3:10]]
    assert sorted(int(r[3]) for r in rows) == [70] * 2 + [71] * 5
    assert all(1.0 <= float(r[6].rstrip("x")) <= 1 + 2 * 25 / 70 for r in rows)
    assert out[10].startswith("imbalance: the largest share is 1 rows above the smallest")
    assert out[-1].startswith("tokens per node vary by about ")
    # data.seed=run: each run's order is its own seed's, which the plan cannot know: one line, before any reading
    assert main(["plan", str(corpus), "--world-size", "7", "data.seed=run"]) == 2
    assert capsys.readouterr().err == ("isollm-data plan: error: data.seed: run: a run's data order is its seed; plan "
                                       "one with data.seed=<that seed>\n")


def test_plan_reads_overrides_after_its_options(tmp_path: Path, bpe: Tokenizer,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pq.read_table(fineweb_files()[0], columns=["text"]).slice(0, 40), corpus / "part.parquet",
                   row_group_size=10)
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    options = ["--world-size", "2", "--tokenizer", str(tok), "--sample-docs", "4"]
    assert main(["plan", str(corpus), "data.seed=3", *options]) == 0
    before = capsys.readouterr().out
    assert main(["plan", str(corpus), *options, "data.seed=3"]) == 0
    assert capsys.readouterr().out == before
    assert main(["plan", str(corpus), *options, "data.no_such_field=1"]) == 2  # read as an override, refused
    assert "no_such_field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(corpus), *options, "stray"])
    assert exit_.value.code == 2 and "unrecognized arguments: stray" in capsys.readouterr().err


def test_prepare_needs_only_data_settings(tmp_path: Path, bpe: Tokenizer, three_shards: Path) -> None:
    """A run config without train.max_steps / max_tokens prepares; --max-tokens stops after the document that
    reaches it (whole documents, at most one past the limit), and the loader reads what was written."""
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  source: {three_shards}\n  val_bucket: 20\n  tokenize_batch: 8\n"
                      "train:\n  max_steps: 0\n  max_tokens: 0\n")
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    out = tmp_path / "prepared"
    assert main(["prepare", "--config", str(config), "--tokenizer", str(tok), "--out", str(out),
                 "--max-tokens", "2e3"]) == 0
    index = json.loads((out / "index.json").read_text())
    tokens = sum(p["num_tokens"] for p in index["pieces"])
    written = np.concatenate([np.fromfile(out / f["tokens"], dtype=np.uint32)
                              for f in index["files"] if f["num_tokens"]])  # a file of no tokens has no file
    ends = np.flatnonzero(written == eos_id(bpe)) + 1  # where each document ends
    assert len(written) == tokens and ends[-1] == tokens and index["max_tokens"] == 2000
    assert ends[-2] < 2000 <= tokens  # the last document is the one that reached the limit
    cfg = DataConfig(source=str(three_shards), val_bucket=20, tokenize_batch=8, seq_len=32, shuffle_block=4,
                     tokenizer=str(tok), prepared=str(out))
    assert next(iter(build_train_loader(cfg, bpe, 2, 0, 1))).shape == (2, 33)
    assert main(["prepare", "--config", str(config), "--out", str(out), "train.max_steps=5"]) == 2


def test_prepare_reads_the_data_settings_of_included_configs(tmp_path: Path, bpe: Tokenizer,
                                                             three_shards: Path) -> None:
    """The data section of a file a run config lists under ``defaults:`` counts, as it does for train.py."""
    (tmp_path / "base.yaml").write_text("data:\n  val_bucket: 20\n  tokenize_batch: 8\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"defaults: [base.yaml]\ndata:\n  source: {three_shards}\n")
    tok = tmp_path / "tok.json"
    bpe.save(str(tok))
    out = tmp_path / "prepared"
    assert main(["prepare", "--config", str(config), "--tokenizer", str(tok), "--out", str(out),
                 "--max-tokens", "1e3"]) == 0
    assert json.loads((out / "index.json").read_text())["val_bucket"] == 20
    (tmp_path / "bad.yaml").write_text("data: [\n")
    assert main(["prepare", "--config", str(tmp_path / "bad.yaml"), "--out", str(out)]) == 2  # one line

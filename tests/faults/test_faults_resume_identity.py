"""A resume continues only what the run was: another seed, another tokenizer at the run's tokenizer path, or its
``data.prepared`` prepared again are refused in one line naming the recorded and the current value (exit 2), before
anything in the run directory is written. ``config.yaml`` is written atomically (a file-size limit, as a full disk,
leaves it whole), and a saved config without one of its sections is refused, naming the file, instead of being
filled with today's defaults."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from tiny import metrics_rows
from tokenizers import Tokenizer

from llm.cli.train import main
from llm.config import RunConfig, load_config
from llm.data import train_tokenizer
from llm.data.shards import prepare
from llm.data.tokenizer import tokenizer_identity
from llm.eval.runs import load_run
from llm.model.config import ConfigError
from llm.train.checkpoint import load_checkpoint
from llm.train.checkpoint_files import write_manifest
from llm.train.lock import LOCK_FILE
from llm.train.run_identity import CHECKED_APART, RESUMABLE
from llm.train.trainer import fit

SAVE = ["train.max_steps=2", "train.checkpoint_every=2"]
RESUME_ADVICE = ("a resume changes only what llm.train.run_identity.RESUMABLE lists: resume with the checkpoint's "
                 "values, or start another run (name=)")


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_resume_with_another_seed_is_refused(run_overrides: list[str], tmp_path: Path, capsys) -> None:
    """Before, it trained on from seed 1's weights, data order and RNG, and compare counted it as seed 2."""
    assert main([*run_overrides, "name=s", "seed=1", *SAVE]) == 0
    run_dir = tmp_path / "runs" / "s"
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*run_overrides, "name=s", "seed=2", "train.max_steps=4", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: seed: checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained with other run settings: "
        f"seed (checkpoint 1, config 2); {RESUME_ADVICE}"]
    assert _files(run_dir) == before


def test_resume_on_another_tokenizer_at_the_same_path_is_refused(run_overrides: list[str], corpus: Path, bpe: Path,
                                                                 tmp_path: Path, capsys) -> None:
    """Another BPE of the same size at the run's tokenizer path: before, the run resumed on other ids silently."""
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_bytes(bpe.read_bytes())
    args = [*run_overrides, f"data.tokenizer={tokenizer}", "name=t"]
    assert main([*args, *SAVE]) == 0
    run_dir = tmp_path / "runs" / "t"
    recorded = tokenizer_identity(Tokenizer.from_file(str(bpe)))
    other = train_tokenizer([str(sorted(corpus.iterdir())[0])], 512, tokenizer)  # one file of three: other merges
    assert other.get_vocab_size() == 512 and tokenizer_identity(other) != recorded
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert _error_lines(capsys.readouterr().err) == [
        f"error: data.tokenizer: checkpoint {checkpoint} was trained with another tokenizer (fingerprint "
        f"{tokenizer_identity(Tokenizer.from_file(str(bpe)))}, data.tokenizer's {tokenizer_identity(other)}): resume "
        f"with the tokenizer it saves, {checkpoint / 'model' / 'tokenizer.json'}"]
    assert _files(run_dir) == before
    fingerprints = metrics_rows(run_dir, "meta")[0]["data_fingerprints"]
    assert fingerprints == {"tokenizer": recorded, "prepared": None, "source": fingerprints["source"]}
    assert load_run(run_dir).segments[0][1]["data_fingerprint.tokenizer"] == recorded  # compare's history has it


def test_resume_on_prepared_data_prepared_again_is_refused(run_overrides: list[str], tmp_path: Path,
                                                           capsys) -> None:
    """``data.prepared`` prepared again with another --max-tokens: before, the run resumed on other tokens."""
    from llm.config import load_config
    from llm.data import load_tokenizer

    out = tmp_path / "prepared"
    args = [*run_overrides, f"data.prepared={out}", "name=p"]
    data_cfg = load_config([], [*args, *SAVE]).data
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    prepare(data_cfg, tokenizer, out, max_tokens=20_000)
    assert main([*args, *SAVE]) == 0
    run_dir = tmp_path / "runs" / "p"
    prepare(data_cfg, tokenizer, out, max_tokens=8_000)
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    [line] = _error_lines(capsys.readouterr().err)
    was, now = re.fullmatch(r"error: data loader state: prepared_fingerprint was '(\w+)', this loader has '(\w+)'; "
                            r"resume with the same data settings and files", line).groups()
    assert was != now
    assert _files(run_dir) == before
    recorded = metrics_rows(run_dir, "meta")[0]["data_fingerprints"]
    assert recorded == {"tokenizer": tokenizer_identity(tokenizer), "prepared": was, "source": recorded["source"]}
    assert load_run(run_dir).segments[0][1]["data_fingerprint.prepared"] == was  # compare's history has it


def _limit_file_size() -> None:
    """In the child: files may not grow past 1 KiB (a full disk; Python ignores SIGXFSZ, so a write fails with
    EFBIG); the run's config.yaml holds about 2 KiB."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_config_yaml_is_written_whole_or_not_at_all(run_overrides: list[str], tmp_path: Path) -> None:
    """Before, config.yaml was written in place: the write that failed left it cut at 1 KiB, and the message said
    nothing in the directory was changed."""
    args = [*run_overrides, "name=c", *SAVE]
    assert main(args) == 0
    run_dir = tmp_path / "runs" / "c"
    before = _files(run_dir)
    assert len(before["config.yaml"]) > 1024
    resume = [*args, "train.max_steps=4", "resume=true"]
    proc = subprocess.run([sys.executable, "-c", "import sys; from llm.cli.train import main; sys.exit(main("
                           f"{json.dumps(resume)}))"], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_file_size)
    assert proc.returncode == 1, proc.stderr
    [line] = _error_lines(proc.stderr)
    assert line.startswith(f"error: could not write to {run_dir} (OSError: [Errno 27] File too large")
    assert line.endswith("its config.yaml and metrics.jsonl are each as they were or wholly rewritten, none cut short")
    assert _files(run_dir) == before  # config.yaml whole, no temporary file left, the lock released
    assert main(resume) == 0  # room again


def test_a_saved_config_without_a_section_is_refused(run_overrides: list[str], tmp_path: Path, capsys) -> None:
    """Before, the model section fell back to today's defaults (and the run then met its checkpoint's model)."""
    args = [*run_overrides, "name=m"]
    assert main([*args, *SAVE]) == 0
    saved = tmp_path / "runs" / "m" / "config.yaml"
    text = saved.read_text()
    saved.write_text(text[: text.index("\nmodel:\n") + 1] + text[text.index("\ndata:\n") + 1 :])  # cut at sections
    before = _files(saved.parent)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: config: {saved} lacks the model section(s) every run saves (the file is damaged): restore it, or "
        f"pass the run's config files with --config"]
    assert _files(saved.parent) == before and LOCK_FILE not in before


def test_a_saved_config_cut_before_its_train_section_is_refused(run_overrides: list[str], tmp_path: Path,
                                                               capsys) -> None:
    """A config cut where its train section began (a write that failed there): before, the resume trained on with
    today's defaults (global_batch_tokens 524,288, lr 3e-4, warmup 100)."""
    args = [*run_overrides, "name=n"]
    assert main([*args, *SAVE]) == 0
    saved = tmp_path / "runs" / "n" / "config.yaml"
    text = saved.read_text()
    saved.write_text(text[: text.index("\ntrain:\n") + 1])
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: config: {saved} lacks the train section(s) every run saves")


def test_a_saved_config_cut_inside_a_section_is_refused(run_overrides: list[str], tmp_path: Path, capsys) -> None:
    """config.yaml cut inside its train section, every header intact: before, the resume filled the lost keys from
    today's defaults (keep_checkpoints 3 pruned the run's checkpoints, global_batch_tokens 524,288)."""
    args = [*run_overrides, "name=i"]
    assert main([*args, *SAVE]) == 0
    saved = tmp_path / "runs" / "i" / "config.yaml"
    lines = saved.read_text().splitlines(keepends=True)
    cut = lines.index("train:\n") + 3
    saved.write_text("".join(lines[:cut]))
    lost = lines[cut].split(":")[0].strip()
    before = _files(saved.parent)
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    reference = saved.parent / "checkpoints" / "step_00000002" / "config.yaml"
    [line] = _error_lines(capsys.readouterr().err)
    assert re.fullmatch(rf"error: config: {saved} lacks train\.{lost} and \d+ more key\(s\), which the checkpoint "
                        rf"config {reference} holds \(the file is damaged\): restore it from there", line), line
    assert _files(saved.parent) == before
    saved.unlink()  # deleted: before, "no run 'i' to resume" beside its checkpoints
    assert main([*args, "train.max_steps=4", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: config: {saved} is missing, but the run holds 1 checkpoint(s): restore it (e.g. copy {reference}) "
        f"to resume"]
    assert main([*args, "train.max_steps=4", "resume=1"]) == 2  # before: a type-hint message
    assert _error_lines(capsys.readouterr().err) == ["error: resume: expected true, false or restart, got '1'"]


def test_a_token_budget_resumed_with_another_global_batch_is_refused(run_overrides: list[str], tmp_path: Path,
                                                                      capsys) -> None:
    """Before: max_steps recomputed from train.max_tokens (8 -> 4 here), the run ended at another token count than
    its budget, the lr schedule jumping, exit 0 and no line."""
    budget = ["train.max_tokens=2048", "train.checkpoint_every=2"]
    assert main([*run_overrides, "name=b", *budget, "train.max_steps=0", "train.global_batch_tokens=256",
                 "train.max_tokens=512"]) == 0
    run_dir = tmp_path / "runs" / "b"
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*run_overrides, "name=b", *budget, "train.global_batch_tokens=512", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: train.global_batch_tokens: checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained with "
        f"other run settings: train.global_batch_tokens (checkpoint 256, config 512); {RESUME_ADVICE}"]
    assert _files(run_dir) == before
    assert main([*run_overrides, "name=b", *budget, "train.global_batch_tokens=256", "resume=true"]) == 0
    assert metrics_rows(run_dir, "train")[-1]["tokens"] == 2048


@pytest.mark.parametrize(("override", "difference"), [
    ("data.text_column=id", "text_column (recorded 'text', now 'id')"),  # trained on another column
    ("data.id_column=null", "id_column (recorded 'id', now None)"),  # the validation split moved
    ("data.document_masking=false", "document_masking (recorded True, now False)"),  # the model's view changed
    ("data.val_tokens=100", "val_tokens (recorded 330, now 100)"),  # the val curve on another set from here on
])
def test_a_resume_on_any_other_data_field_is_refused(override: str, difference: str, run_overrides: list[str],
                                                     tmp_path: Path, capsys) -> None:
    """The data identity is every data field but a declared few (llm.data.identity). Before, it was a list of
    eight: each of these resumed without a line."""
    assert main([*run_overrides, "name=d", *SAVE]) == 0
    run_dir = tmp_path / "runs" / "d"
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*run_overrides, "name=d", override, "train.max_steps=4", "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: data: checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained on other data settings: "
        f"{difference}; they change the tokens, the split or how the model sees them: resume with the checkpoint's, "
        f"or start another run (name=)"]
    assert _files(run_dir) == before


def test_a_resume_with_fields_that_cannot_change_a_token_continues(run_overrides: list[str], tmp_path: Path) -> None:
    """The declared exemptions: batching of the tokenizer, retries; the run continues to its end."""
    assert main([*run_overrides, "name=e", *SAVE]) == 0
    assert main([*run_overrides, "name=e", "data.tokenize_batch=7", "data.read_retries=1", "data.retry_backoff_s=0.5",
                 "train.max_steps=4", "resume=true"]) == 0
    assert [row["step"] for row in metrics_rows(tmp_path / "runs" / "e", "train")] == [1, 2, 3, 4]


def test_a_resume_with_another_optimizer_setting_is_refused(run_overrides: list[str], tmp_path: Path,
                                                            capsys) -> None:
    """Before: exit 0, config.yaml and the meta row saying beta1 0.8, while the optimizer state loaded over it kept
    training at 0.9 (torch's ``load_state_dict`` restores each group's betas). ``RESUMABLE``'s train fields changed
    at once (but ``compile``, slow on CPU, and ``micro_batch_size``, which the streamed loader's state holds with its
    topology) continue to the new end."""
    assert main([*run_overrides, "name=o", *SAVE]) == 0
    run_dir = tmp_path / "runs" / "o"
    before = _files(run_dir)
    capsys.readouterr()
    assert main([*run_overrides, "name=o", "train.beta1=0.8", "train.eps=1e-6", "train.max_steps=4",
                 "resume=true"]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"error: train.beta1, train.eps: checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained with "
        f"other run settings: train.beta1 (checkpoint 0.9, config 0.8), train.eps (checkpoint 1e-08, config 1e-06); "
        f"{RESUME_ADVICE}"]
    assert _files(run_dir) == before
    resumable = ["train.max_steps=5", "train.lr=0.0015", "train.min_lr_ratio=0.5", "train.weight_decay=0.05",
                 "train.log_every=2", "train.eval_every=3", "train.checkpoint_every=3",
                 "train.keep_checkpoints=1", "train.activation_checkpointing=1", "train.isotropy_samples=64",
                 "train.grad_norm_window=3", "train.max_bad_steps=2", "train.collective_timeout_s=600",
                 "train.stop_grace_s=60", "wandb_project=other"]
    assert main([*run_overrides, "name=o", *resumable, "resume=true"]) == 0
    assert [row["step"] for row in metrics_rows(run_dir, "train")] == [1, 2, 4, 5]
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000005"]


def _other_value(key: str, value: Any) -> Any:
    """A valid value of field ``key`` other than ``value``: the other choice, the other truth value, twice the integer,
    half the number, a longer string."""
    choices = {"train.optimizer": "muon", "train.precision": "bf16", "trackers": ["tensorboard"]}
    if key in choices:
        return choices[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 or 1 if isinstance(value, int) else value / 2
    if isinstance(value, str):
        return f"{value}x"
    raise TypeError(f"{key}: no other value of {value!r} known here; add one to the choices above")


def _run_fields() -> list[str]:
    """Every field of ``RunConfig`` outside ``CHECKED_APART``, a section's (``TrainConfig``'s) by dotted name."""
    keys, default = [], RunConfig()
    for top in (f for f in fields(RunConfig) if f.name not in CHECKED_APART):
        section = getattr(default, top.name)
        keys += [f"{top.name}.{f.name}" for f in fields(section)] if is_dataclass(section) else [top.name]
    return keys


class _ChecksPassed(Exception):
    """Raised by the stand-in loader: every check of ``load_checkpoint`` before the loader state passed."""


class _Loader:
    def load_state_dicts(self, states: list[dict]) -> None:
        raise _ChecksPassed


@pytest.fixture(scope="module")
def checkpoint(overrides_under, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = load_config([], [*overrides_under(tmp_path_factory.mktemp("identity")), "name=i", "train.max_steps=1"])
    return fit(config).last_checkpoint


@pytest.mark.parametrize("key", _run_fields())
def test_a_resume_changing_any_run_field_is_refused_unless_declared_resumable(key: str, checkpoint: Path) -> None:
    """Every field of ``TrainConfig`` and the top-level ``RunConfig`` fields, a new one included, changed alone: refused
    naming it with both values, or, declared ``RESUMABLE``, through every check to the loader state. Before, a list
    of three (the seed, the global batch under max_tokens, the optimizer): the betas, eps, the clipping, the
    precision and planned_by resumed without a line."""
    saved = load_config(str(checkpoint / "config.yaml"), saved_run=True)
    section, _, name = key.rpartition(".")
    old = getattr(getattr(saved, section) if section else saved, name)
    new = _other_value(key, old)
    config = (replace(saved, **{section: replace(getattr(saved, section), **{name: new})}) if section
              else replace(saved, **{name: new})).validate()
    tokenizer = Tokenizer.from_file(str(checkpoint / "model" / "tokenizer.json"))
    if key in RESUMABLE:
        with pytest.raises(_ChecksPassed):
            load_checkpoint(checkpoint, accelerator=None, loader=_Loader(), config=config, tokenizer=tokenizer)
        return
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(checkpoint, accelerator=None, loader=_Loader(), config=config, tokenizer=tokenizer)
    assert str(refused.value) == (f"{key}: checkpoint {checkpoint} was trained with other run settings: {key} "
                                  f"(checkpoint {old!r}, config {new!r}); {RESUME_ADVICE}")


def test_a_checkpoint_from_before_a_train_field_resumes_as_it_trained(run_overrides: list[str], tmp_path: Path) -> None:
    """A run saved before ``train.optimizer`` and ``train.tf32`` existed (each config.yaml without them) resumes by
    name, not refused for predating them, and trains on as it did: AdamW, no TF32. Before, it resumed under TF32
    (today's default) on CUDA, its config and meta row saying so."""
    assert main([*run_overrides, "name=old", *SAVE]) == 0
    run_dir = tmp_path / "runs" / "old"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    for saved in (run_dir / "config.yaml", checkpoint / "config.yaml"):
        lines = saved.read_text().splitlines(keepends=True)
        saved.write_text("".join(line for line in lines if line.strip().split(":")[0] not in ("optimizer", "tf32")))
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)  # the checkpoint as its code wrote it, checksums included
    assert main([f"out_dir={tmp_path / 'runs'}", "name=old", "train.max_steps=4", "resume=true"]) == 0
    meta = metrics_rows(run_dir, "meta")[-1]
    assert meta["resumed_from"] == str(checkpoint)
    assert (meta["config"]["train"]["optimizer"], meta["config"]["train"]["tf32"]) == ("adamw", False)

"""``isollm-hub``: publish a run or checkpoint to the Hugging Face hub, with its model card.

    isollm-hub push RUN_OR_CHECKPOINT REPO_ID [--private] [--revision R] [--qwen3] [--stage DIR]

RUN_OR_CHECKPOINT is a run directory (its newest complete checkpoint), a checkpoint directory or its
``model/`` directory. What is uploaded: the checkpoint's ``model/`` directory (config with
``auto_map``, the modelling code, safetensors, tokenizer), or with ``--qwen3`` the stock-Qwen3 export
of a swiglu+softmax model (no code), plus a generated ``README.md`` model card (``llm.hf.card``).
The upload (one commit through ``huggingface_hub.HfApi``) uses the token of ``huggingface-cli login`` or ``HF_TOKEN``.

Exit codes: 0 uploaded, 1 the hub refused or could not be reached, 2 bad arguments or checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from llm.data.errors import DataError
from llm.errors import one_line_warnings
from llm.eval.errors import EvalError
from llm.model.config import ConfigError

__all__ = ["main", "push", "stage"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isollm-hub", description="Publish isollm checkpoints to the hub.")
    commands = parser.add_subparsers(dest="command", required=True)
    push_parser = commands.add_parser("push", help="upload a checkpoint's model directory and its model card")
    push_parser.add_argument("target", metavar="RUN_OR_CHECKPOINT",
                             help="run directory, checkpoint directory or its model/ directory")
    push_parser.add_argument("repo_id", metavar="REPO_ID", help="hub repository, e.g. user/isollm-83m-isogmlp")
    push_parser.add_argument("--private", action="store_true", help="create the repository private")
    push_parser.add_argument("--revision", default=None, help="branch to upload to (created if missing)")
    push_parser.add_argument("--qwen3", action="store_true",
                             help="upload the stock Qwen3 export (swiglu+softmax only; loads with no remote code)")
    push_parser.add_argument("--stage", default=None, metavar="DIR",
                             help="build the upload in DIR and keep it (default: a temporary directory)")
    return parser


def stage(target: str, repo_id: str, directory: Path, qwen3: bool = False) -> Path:
    """Write into ``directory`` exactly what ``push`` uploads: the model directory and its ``README.md``."""
    from llm.data import load_tokenizer
    from llm.eval.evaluate import check_weights_fit, resolve_checkpoint
    from llm.hf.card import model_card, run_summary, val_bits_per_byte
    from llm.hf.qwen3 import export_qwen3
    from llm.model import IsoLLMConfig, IsoLLMForCausalLM

    resolved = resolve_checkpoint(target)
    if not resolved.is_local:
        raise FileNotFoundError(f"{target}: no such run, checkpoint or model directory")
    model_dir = Path(resolved.model_path)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type != IsoLLMConfig.model_type:
        raise EvalError(f"{model_dir}: not an isollm model directory (model_type {model_type!r})")
    config = IsoLLMConfig.from_pretrained(model_dir)
    check_weights_fit(model_dir, config)  # nothing uploaded or exported that would not load
    if qwen3:
        model = IsoLLMForCausalLM.from_pretrained(model_dir, dtype="auto")
        export_qwen3(model, directory, load_tokenizer(str(model_dir)))
    else:
        shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    run = None
    checkpoint = resolved.checkpoint_dir
    if checkpoint is not None and (checkpoint / "trainer.json").is_file() and resolved.config_file:
        run = run_summary(checkpoint)
        if run.val_loss is not None:
            run.bits_per_byte = val_bits_per_byte(checkpoint, run.val_loss)
    card = model_card(config.to_model_config(), run=run, qwen3=qwen3, repo_id=repo_id)
    (directory / "README.md").write_text(card)
    return directory


def push(staged: Path, repo_id: str, *, private: bool = False, revision: str | None = None) -> str:
    """Upload the folder ``staged`` to ``repo_id`` (created if missing) in one commit; return its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=staged, repo_type="model", revision=revision,
                               commit_message="Upload isollm model and card")
    return str(getattr(commit, "commit_url", None) or commit)


def _push(args: argparse.Namespace) -> int:
    if args.stage and Path(args.stage).exists() and any(Path(args.stage).iterdir()):
        raise EvalError(f"--stage {args.stage}: not empty (everything in it would be uploaded)")
    with tempfile.TemporaryDirectory(prefix="isollm-hub-") as scratch:
        directory = Path(args.stage) if args.stage else Path(scratch) / "upload"
        staged = stage(args.target, args.repo_id, directory, qwen3=args.qwen3)
        print(f"staged {', '.join(sorted(p.name for p in staged.iterdir()))}")
        from llm.hub_access import hub_unreachable

        if (unreachable := hub_unreachable()) is not None:
            print(f"error: push to {args.repo_id}: could not reach the hub ({unreachable}); nothing was uploaded",
                  file=sys.stderr)
            return 1
        try:
            url = push(staged, args.repo_id, private=args.private, revision=args.revision)
        except OSError as err:  # requests' connection and HTTP errors (HfHubHTTPError included)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"error: push to {args.repo_id} failed: {reason}", file=sys.stderr)
            return 1
    print(f"pushed {args.repo_id}: {url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    one_line_warnings()
    args = _parser().parse_args(argv)
    try:
        return _push(args)
    except (ConfigError, DataError, EvalError, FileNotFoundError) as err:  # not bugs: one line
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

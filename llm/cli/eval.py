"""``eval.py``: evaluate a checkpoint or hub model, compare runs, or run lm-evaluation-harness tasks.

    python eval.py CHECKPOINT_OR_HUB_ID [--config data.yaml] [key=value ...] [--json] [--samples N]
    python eval.py CHECKPOINT_OR_HUB_ID --text FILE [--stride N] [--json]
    python eval.py compare RUN_DIR... | 'runs/*' [--baseline swiglu+softmax] [--tune train.lr] [--target-gap 0.01]
                           [--plan 0.02 | --planned PLAN_CSV] [--out DIR]
    python eval.py lm-eval CHECKPOINT_OR_HUB_ID --tasks hellaswag,arc_easy [--limit N]

CHECKPOINT is a run directory (its newest complete checkpoint), a checkpoint directory or its
``model/`` directory; a local directory named ``compare`` or ``lm-eval`` is given as ``./compare``.
Exit codes: 0 done, 2 bad arguments, path or configuration (one ``error: ...`` line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any

from llm.cli.arg_types import at_least
from llm.data.errors import DataError
from llm.eval.errors import EvalError
from llm.model.config import ConfigError

__all__ = ["main"]


def _gap_nats(text: str) -> float:
    """``--target-gap`` and ``--plan``: a finite gap > 0 (a gap of 0 or inf has no seed count)."""
    if not 0 < (value := float(text)) < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite gap > 0 nats, got {text}")
    return value


_gap_nats.__name__ = "float"  # argparse names the type in "invalid float value" messages


def _common_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="CHECKPOINT_OR_HUB_ID",
                        help="run directory, checkpoint directory, model/ directory or hub id")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run a hub model's own modelling code (never needed for isollm checkpoints)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")


def _evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eval.py", description="Evaluate a checkpoint or hub model: val loss, perplexity, bits per "
        "byte, per-layer isotropy and alpha/beta, samples. Subcommands: compare, lm-eval (see their --help).")
    _common_model_args(parser)
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML merged over the checkpoint's config.yaml (e.g. another data: section)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides, e.g. data.source=/path/*.parquet data.val_tokens=65536; "
                        "evaluation runs in the run's train.precision (bf16 autocast for a bf16 run, on CPU "
                        "too: train.precision=fp32 evaluates in fp32)")
    parser.add_argument("--samples", type=at_least(0), default=3,
                        help="generated samples, one per fixed prompt (at most 5; 0: none)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=32)
    parser.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0: greedy; > 0: seeded sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--text", metavar="FILE", help="instead: the perplexity of a text file (llm.eval.text_file)")
    parser.add_argument("--stride", type=at_least(1), help="with --text: tokens between windows (data.seq_len / 2)")
    return parser


def _compare_parser() -> argparse.ArgumentParser:
    from llm.eval.compare import DEFAULT_BASELINE

    parser = argparse.ArgumentParser(
        prog="eval.py compare", description="Table (in the style of isogmlp Table 1) and plots of runs "
        "grouped into rows of one configuration over seeds (llm.eval.grouping); a variant at several model sizes "
        "adds the scaling view (scaling.png).")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories or quoted glob patterns")
    parser.add_argument("--baseline", default=None,
                        help=f"row the p-values test against (default {DEFAULT_BASELINE}, when present): a row label "
                        "as the table prints it (with the differing fields in parentheses where rows share a variant "
                        "name, e.g. 'swiglu+softmax (train.lr=0.001)') or the key printed after it ([3fa2c1]), a "
                        "variant name or an FFN name of one row, or "
                        "of one variant's rows at several model sizes (swiglu: each row is tested against the "
                        "baseline of its size); a name of several rows or of none is an error listing the rows")
    parser.add_argument("--tune", action="append", default=[], metavar="KEY",
                        help="config key tuned per variant (repeatable, e.g. --tune train.lr): runs differing only in "
                        "it and the seed are one variant, reported at the value with the lowest mean final val "
                        "loss over the seeds the values share; adds the sensitivity table and <key>_sensitivity.png")
    parser.add_argument("--target-gap", type=_gap_nats, default=None, metavar="NATS",
                        help="the smallest gap worth detecting, chosen before the runs: adds the seeds per arm it "
                        "needs at each row's and its baseline's observed spreads (choosing seeds: docs/comparison.md)")
    plan = parser.add_mutually_exclusive_group()  # planning from the planned seeds would be a second look
    plan.add_argument("--plan", type=_gap_nats, default=None, metavar="NATS",
                        help="plan the seeds each row needs to resolve this gap from the seeds run so far (the pilot): "
                        "writes plan.csv and plan-sweep.yaml, the missing seeds for launch/sweep.py (llm.eval.plan)")
    plan.add_argument("--planned", default=None, metavar="PLAN_CSV",
                        help="the plan.csv the seeds were planned by (--plan): each planned row's verdict is then "
                        "the plan's final test (Stein's), which the table's p-values are not")
    parser.add_argument("--out", default="comparison", help="directory for comparison.md/.csv and PNG plots")
    parser.add_argument("--no-plots", action="store_true")
    return parser


def _lm_eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eval.py lm-eval", description="lm-evaluation-harness tasks on a checkpoint (extra: lmeval).")
    _common_model_args(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    parser.add_argument("--num-fewshot", type=at_least(0), default=None)
    parser.add_argument("--limit", type=at_least(0.0, float), default=None,
                        help="examples per task (a fraction if < 1)")
    parser.add_argument("--batch-size", type=at_least(1), default=8)
    parser.add_argument("--include-path", default=None, help="directory of extra task YAMLs")
    parser.add_argument("--no-default-tasks", action="store_true",
                        help="only the tasks under --include-path (skips indexing lm_eval's built-in tasks)")
    return parser


def _json(value: Any) -> str:
    """``value`` as indented JSON with NaN written as null (NaN is not JSON), and what JSON cannot hold as text."""
    read_back = json.loads(json.dumps(value, default=str), parse_constant=lambda c: None if c == "NaN" else float(c))
    return json.dumps(read_back, indent=1)


def _evaluate(argv: list[str]) -> int:
    from llm.eval.evaluate import evaluate_checkpoint, format_report

    args = _evaluate_parser().parse_intermixed_args(argv)  # overrides may follow options
    if args.stride is not None and args.text is None:
        raise EvalError("--stride: only with --text FILE (the windows over a text file)")
    if args.text is not None:
        from llm.eval.text_file import evaluate_text, format_text_report

        scored = evaluate_text(args.target, args.text, args.stride, config_files=args.config, overrides=args.overrides,
                               trust_remote_code=args.trust_remote_code, device=args.device)
        print(_json(scored) if args.json else format_text_report(scored), end="\n" if args.json else "")
        return 0
    report = evaluate_checkpoint(args.target, config_files=args.config, overrides=args.overrides, samples=args.samples,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                 trust_remote_code=args.trust_remote_code, device=args.device)
    print(_json(asdict(report)) if args.json else format_report(report), end="\n" if args.json else "")
    return 0


def _compare(argv: list[str]) -> int:
    from llm.eval.compare import compare_runs
    from llm.eval.plan import plan_seeds, write_plan
    from llm.eval.planned import apply_plan
    from llm.eval.report import format_table, write_comparison
    from llm.eval.runs import expand_run_dirs, load_run
    from llm.eval.scaling import scaling_series

    args = _compare_parser().parse_intermixed_args(argv)  # run directories may follow options
    runs, unreadable = [], []
    for run_dir in expand_run_dirs(args.runs):
        try:
            runs.append(load_run(run_dir))
        except (EvalError, FileNotFoundError) as err:  # one damaged run does not hide the others
            unreadable.append(str(err))
    if not runs:
        raise EvalError("; ".join(unreadable))
    comparison = compare_runs(runs, args.baseline, args.tune, args.target_gap)
    plans = None if args.plan is None else plan_seeds(comparison, args.plan)  # a bad --plan fails before any writing
    if args.planned and (unplanned := apply_plan(comparison, args.planned)):  # compared again without them
        comparison = compare_runs([run for run in runs if run not in unplanned], args.baseline, args.tune,
                                  args.target_gap)
        apply_plan(comparison, args.planned)
        comparison.warnings += [f"{run.path.name}: seed {run.seed} is no planned seed of its row; left out of the "
                                "planned test" for run in unplanned]
    comparison.warnings[:0] = [f"{message}; left out" for message in unreadable]  # comparison.md names them too
    for warning in comparison.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    plan, written = write_plan(comparison, plans, args.plan, args.out) if plans is not None else ("", [])
    written[:0] = write_comparison(comparison, args.out)
    if not args.no_plots:
        from llm.eval.plots import write_plots

        written += write_plots(comparison.groups, args.out, comparison.sensitivity, comparison.tune,
                               scaling_series(comparison))
    print(format_table(comparison, full=written[0]))  # written[0]: comparison.md
    if plan:
        print(plan)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _lm_eval(argv: list[str]) -> int:
    from llm.eval.evaluate import eval_device, load_model, resolve_checkpoint
    from llm.eval.lm_eval_adapter import hf_tokenizer, run_lm_eval

    args = _lm_eval_parser().parse_args(argv)
    device = str(eval_device(args.device))  # before the model is loaded
    resolved = resolve_checkpoint(args.target)
    model = load_model(resolved, args.trust_remote_code, device)
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    results = run_lm_eval(model, hf_tokenizer(resolved.model_path, args.trust_remote_code), args.tasks.split(","),
                          num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
                          include_path=args.include_path, include_defaults=not args.no_default_tasks, device=device)
    if args.json:
        print(_json(results))
    else:
        for task, metrics in results.items():
            for name, value in metrics.items():
                if isinstance(value, float):
                    print(f"{task:30s} {name:30s} {value:.4f}")
    return 0


COMMANDS = {"compare": _compare, "lm-eval": _lm_eval}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = COMMANDS.get(argv[0]) if argv else None
    try:
        return command(argv[1:]) if command else _evaluate(argv)
    except (ConfigError, DataError, EvalError, FileNotFoundError, ImportError) as err:  # not bugs: one line
        print(f"error: {err}", file=sys.stderr)
        return 2


def run() -> None:
    from llm.errors import one_line_warnings

    one_line_warnings()
    sys.exit(main())


if __name__ == "__main__":
    run()


"""The README demo: train SwiGLU and IsoGMLP side by side on real text, three seeds each, then compare them.

``scripts/demo.sh [key=value ...]`` (what ``make demo`` runs; ``python scripts/demo.py`` where ``llm`` is installed):

1. text: FineWeb streamed from the hub when online (a few thousand documents, saved locally so every
   run reads the same file); offline the FineWeb sample in ``../shared/data/`` beside the checkout
   when present; otherwise the docstrings of this Python installation's standard library, a corpus
   every Python carries. It says which it used.
2. a byte-level BPE of 4,096 tokens trained on that text (``llm.data.train_tokenizer``).
3. ``train.py --config configs/demo.yaml`` for ``model.ffn=swiglu`` and ``model.ffn=isogmlp``
   (parameter-matched, same batches) at seeds 0, 1 and 2: a seed's two runs at once with one thread each
   (tiny matmuls gain little from a second thread, so two runs in parallel finish sooner than two in a row).
   One seed per variant gives a gap with no interval; three give the gap's interval, its verdict and a plan.
4. ``eval.py`` on each variant's seed-0 checkpoint (val loss, bits per byte, isotropy, samples), then
   ``eval.py compare`` on the six run directories with ``--plan 0.1``: the table, the gap to SwiGLU with its
   interval and verdict, and the seeds per arm a 0.1-nat gap would need from these three as a pilot.

Runs are ``runs/demo-<ffn>-s<seed>`` and start with ``resume=true``, so running the demo again continues (or
just re-compares) them; delete them to start over. Extra arguments are passed to every ``train.py`` call
(e.g. ``train.max_steps=50``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "data_cache" / "demo"  # beside the validation caches (git-ignored)
SHARED_SAMPLE = REPO.parent / "shared" / "data" / "fineweb-sample"
# PLAN_GAP: a gap this size can resolve with tens of seeds (0.02 would take hundreds at its ~0.04-nat spread)
VARIANTS, SEEDS, PLAN_GAP = ("swiglu", "isogmlp"), (0, 1, 2), "0.1"
HUB_DOCS = 4000
HUB_TIMEOUT_S = 60.0
VOCAB_SIZE = 4096


def _stream_fineweb(out: Path) -> None:
    """Save the first ``HUB_DOCS`` documents of FineWeb's sample-10BT stream as parquet."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = datasets.load_dataset("HuggingFaceFW/fineweb", name="sample-10BT", split="train", streaming=True)
    rows = [{"text": doc["text"], "id": doc["id"]} for doc in stream.take(HUB_DOCS)]
    pq.write_table(pa.Table.from_pylist(rows), out.with_suffix(".tmp"))
    os.replace(out.with_suffix(".tmp"), out)


def _try_hub(out: Path) -> bool:
    """Stream FineWeb in a worker thread, giving up after ``HUB_TIMEOUT_S`` (no network: fail fast: one TCP
    connection to the hub's endpoint first, ``hub_unreachable``, so an offline machine does not sit through
    ``datasets``' retries)."""
    from llm.hub_access import hub_unreachable

    offline = any(os.environ.get(key, "0").lower() in ("1", "true", "yes")
                  for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if offline or hub_unreachable():
        return False
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _stream_fineweb(out)
        except Exception as err:  # any failure (DNS, HTTP, auth) means: use a local corpus
            errors.append(err)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    if thread.is_alive() or errors:
        reason = (f"timed out after {HUB_TIMEOUT_S:.0f} s" if thread.is_alive()
                  else str(errors[0]).splitlines()[0])
        print(f"demo: FineWeb from the hub is not reachable ({reason})")
        return False
    return out.is_file()


def _stdlib_corpus(out: Path) -> None:
    """One JSON-lines document per standard-library module: its docstrings (English prose and code)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with open(out.with_suffix(".tmp"), "w") as f:
        for path in sorted(stdlib.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            nodes = [tree, *(n for n in ast.walk(tree)
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
            docs = [d for d in (ast.get_docstring(n) for n in nodes) if d]
            if docs:
                f.write(json.dumps({"id": str(path.relative_to(stdlib)), "text": "\n\n".join(docs)}) + "\n")
    os.replace(out.with_suffix(".tmp"), out)


def choose_source() -> tuple[Path, str, list[str]]:
    """The demo's text, a sentence saying what it is, and config overrides it needs."""
    DEMO_DATA.mkdir(parents=True, exist_ok=True)  # where the text it makes and the tokenizer go
    hub_file = DEMO_DATA / "fineweb-sample-10BT.parquet"
    if hub_file.is_file() or _try_hub(hub_file):  # streamed by an earlier demo
        return hub_file, f"FineWeb sample-10BT from the hub ({HUB_DOCS} documents, saved in {hub_file})", []
    if any(SHARED_SAMPLE.glob("*.parquet")):
        return SHARED_SAMPLE, f"the local FineWeb sample in {SHARED_SAMPLE} (offline)", []
    stdlib_file = DEMO_DATA / "python-stdlib-docstrings.jsonl"
    if not stdlib_file.is_file():
        _stdlib_corpus(stdlib_file)
    # ~760 documents, ~0.5M tokens: hold out 1 in 10 to get a validation set of 16K tokens
    description = f"docstrings of the Python standard library (offline, no FineWeb sample), in {stdlib_file}"
    return stdlib_file, description, ["data.val_bucket=10", "data.val_tokens=16384"]


def progress(run_dir: Path) -> str:
    """Where a run stands, from its metrics.jsonl: its last logged step of all, loss and the time left at its
    last rate (the tokens of the steps left over the logged tokens/s; evaluations add a little)."""
    from llm.eval.runs import read_metrics, step_rows  # skips a line being written

    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    meta, train = step_rows(rows, "meta"), step_rows(rows, "train")
    if not meta:
        return f"{run_dir.name}: starting (tokenizer, model, validation set)"
    total = meta[-1]["max_steps"]
    if not train:
        return f"{run_dir.name}: step 0/{total}"
    last = train[-1]
    left_s = (total - last["step"]) * last["tokens"] / last["step"] / last["tokens_per_s"]
    eta = f"ETA {int(left_s) // 60}m{int(left_s) % 60:02d}s"
    return f"{run_dir.name}: step {last['step']}/{total} loss {last['loss']:.3f} {eta}"


def watch(runs: list[tuple[subprocess.Popen, Path]], every_s: float = 2.0) -> None:
    """Print the runs' progress while any is running, a line only when it changed: one per stage or logged step."""
    shown = ""
    while True:
        running = any(proc.poll() is None for proc, _ in runs)
        line = "demo: " + " | ".join(progress(run_dir) for _, run_dir in runs)
        if line != shown:
            print(line, flush=True)
            shown = line
        if not running:
            return
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(extra):
        print(__doc__)
        return 0
    source, description, source_overrides = choose_source()
    print(f"demo: training on {description}")
    tokenizer = DEMO_DATA / f"bpe{VOCAB_SIZE}-{source.stem}.json"
    if not tokenizer.is_file():
        from llm.data import train_tokenizer

        print(f"demo: training a {VOCAB_SIZE}-token byte-level BPE -> {tokenizer}")
        train_tokenizer([source], VOCAB_SIZE, tokenizer)  # a directory resolves as data.source does

    threads = str(max(1, (os.cpu_count() or 2) // len(VARIANTS)))  # each of a seed's runs
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    run_dirs = []
    for seed in SEEDS:  # one seed's variants at once
        runs: dict[str, subprocess.Popen] = {}
        for ffn in VARIANTS:
            name = f"demo-{ffn}-s{seed}"
            cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "demo.yaml"),
                   f"name={name}", f"seed={seed}", f"model.ffn={ffn}", f"data.source={source}",
                   f"data.tokenizer={tokenizer}", "resume=true", *source_overrides, *extra]
            log = REPO / "runs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"demo: {' '.join(cmd[1:])}  (log: {log})")
            with open(log, "w") as log_file:
                runs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        watch([(proc, REPO / "runs" / name) for name, proc in runs.items()])
        if failed := [name for name, proc in runs.items() if proc.returncode != 0]:
            print(f"demo: training failed for {', '.join(failed)}; see runs/<name>.log", file=sys.stderr)
            return 1
        run_dirs += [REPO / "runs" / name for name in runs]
    for run_dir in run_dirs[: len(VARIANTS)]:  # each variant's seed 0: val loss, bits/byte, isotropy, samples
        evaluate = [sys.executable, str(REPO / "eval.py"), str(run_dir), "--samples", "2", "--temperature", "0.8",
                    "--max-new-tokens", "32"]
        print(f"demo: {' '.join(evaluate[1:])}", flush=True)
        if subprocess.call(evaluate, cwd=REPO, env=env) != 0:
            return 1
    compare = [sys.executable, str(REPO / "eval.py"), "compare", *map(str, run_dirs), "--plan", PLAN_GAP,
               "--out", str(REPO / "runs" / "demo-comparison")]
    print(f"demo: {' '.join(compare[1:])}", flush=True)
    return subprocess.call(compare, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

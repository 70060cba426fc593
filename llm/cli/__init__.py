"""The command-line tools, one module each, installed as ``[project.scripts]``:

- ``isollm-train`` (``train.py``): pretrain a model from YAML configs and overrides (``train``);
- ``isollm-eval`` (``eval.py``): evaluate a checkpoint, compare runs, run lm-eval (``eval``);
- ``isollm-data``: prepare validation caches, plan data, train a tokenizer (``data``);
- ``isollm-params``: parameter counts and the memory plan of a config (``params``);
- ``isollm-sweep`` (``launch/sweep.py``): expand a sweep file, run it here or submit it to Slurm (``sweep``);
- ``isollm-hub``: push a checkpoint to the Hugging Face hub (``hub``).

Each module's ``main(argv) -> int`` is what the tests call; exit codes are in each module's docstring.
"""

"""Pretrain an isollm decoder: ``python train.py --config configs/X.yaml key.sub=value ...``

See ``llm/train/cli.py`` for arguments and exit codes, ``llm/train/trainer.py`` for the loop.
"""

from llm.train.cli import run

if __name__ == "__main__":
    run()

"""Pretrain an isollm decoder: ``python train.py --config configs/X.yaml key.sub=value ...``

See ``llm/cli/train.py`` for arguments and exit codes, ``llm/train/trainer.py`` for the loop.
"""

from llm.cli.train import run

if __name__ == "__main__":
    run()

"""``python -m llm.data`` = ``isollm-data``."""

import sys

from llm.cli.data import main

sys.exit(main())

"""``python -m llm.data`` = ``isollm-data``."""

import sys

from llm.data.cli import main

sys.exit(main())

"""``python -m moe_ep_bench [options]``: the same as ``moe-ep bench``."""

import sys

from .cli import main

sys.exit(main())

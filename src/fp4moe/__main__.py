"""``python -m fp4moe``: the same command line as ``fp4moe``."""

import sys

from .cli import main

sys.exit(main())

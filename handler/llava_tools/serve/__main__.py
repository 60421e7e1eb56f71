"""``python -m llava_tools.serve``: ``llava-serve``."""

import sys

from .cli import main

sys.exit(main())

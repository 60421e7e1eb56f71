"""``python -m llava_tools.compile_cache``: ``llava-compile-cache``."""

import sys

from .cli import main

sys.exit(main())

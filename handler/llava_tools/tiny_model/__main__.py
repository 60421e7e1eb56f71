"""``python -m llava_tools.tiny_model``: ``llava-tiny-model``."""

import sys

from .cli import main

sys.exit(main())

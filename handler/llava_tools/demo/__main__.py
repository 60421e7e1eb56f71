"""``python -m llava_tools.demo``: the scripted demo (``make demo``)."""

import sys

from .scripted import main

sys.exit(main())

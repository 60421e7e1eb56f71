"""``python -m llava_tools.local_endpoint``: ``llava-local-endpoint``."""

import sys

from .endpoint import main

sys.exit(main())

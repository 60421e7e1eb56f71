"""``python -m llava_tools.deploy``: the ``llava-deploy`` command line (:func:`.cli.main`)."""

import sys

from .cli import main

sys.exit(main())

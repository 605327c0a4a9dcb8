"""``python -m runtime``: the command line."""

import sys

from runtime.cli.main import main

sys.exit(main())

"""``python -m core.cli`` is the ``edgeshard`` command."""

import sys

from core.cli import main

sys.exit(main())

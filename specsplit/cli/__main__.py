"""``python -m specsplit.cli``: the same as the ``specsplit`` command."""

import sys

from specsplit.cli.main import main

sys.exit(main())

"""``python -m sfcl.cli``: the same as the ``sfcl`` command."""

import sys

from sfcl.cli import main

sys.exit(main())

"""``python -m extproc.tools`` is the ``extproc-dev`` command."""

import sys

from extproc.tools.cli import main

sys.exit(main())

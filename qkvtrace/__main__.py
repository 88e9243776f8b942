"""``python -m qkvtrace``: the same as the ``qkvtrace`` command."""

import sys

from qkvtrace.cli.main import main

sys.exit(main())

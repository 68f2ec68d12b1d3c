"""``python -m fedprivacy`` is the ``fedprivacy`` command."""

import sys

from fedprivacy.cli import main

sys.exit(main())

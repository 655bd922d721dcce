"""``python -m tidal ...`` runs the ``tidal`` command line."""

import sys

from tidal.cli.main import main

sys.exit(main())

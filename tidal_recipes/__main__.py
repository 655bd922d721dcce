"""``python -m tidal_recipes ...`` runs the ``tidal`` command line."""

import sys

from tidal_recipes.cli.main import main

sys.exit(main())

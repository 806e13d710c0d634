"""``python -m fusedqkv``: the command line (see fusedqkv.cli)."""

import sys

from .cli import main

sys.exit(main())

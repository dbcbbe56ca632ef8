"""``python -m p2pft`` is the ``p2pft`` command."""
import sys

from .cli import main

sys.exit(main())

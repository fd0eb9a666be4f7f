"""``python -m attnzero.ladder [N ...]``: the same as ``attnzero ladder``."""

import sys

from ..cli import main

sys.exit(main(["ladder", *sys.argv[1:]]))

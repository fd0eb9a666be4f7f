"""``python -m attnzero`` runs the same command line as ``attnzero``."""

from .cli import main

raise SystemExit(main())

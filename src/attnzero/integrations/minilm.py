"""all-MiniLM-L6-v2 through attnzero: moved to :mod:`attnzero.demo.minilm`, the demo's model.

This name stays so that ``from attnzero.integrations import minilm`` keeps working.
"""

from ..demo.minilm import Agreement, Attentions, MiniLM, compare, load, model_path, run

__all__ = ["Agreement", "Attentions", "MiniLM", "compare", "load", "model_path", "run"]

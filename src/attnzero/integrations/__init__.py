"""Bridges from other libraries to attnzero.

``attnzero.integrations.transformers.register()`` sends every attention call of a Hugging Face
transformers model through :func:`attnzero.attention`. transformers is an optional extra
(``pip install -e ".[hf]"``); importing this package never imports it.
"""

"""``attnzero demo``: a real model (all-MiniLM-L6-v2) through attnzero — where "it" looks.

One job per module:

    minilm.py    the model: load it with attnzero as its attention, run sentences, compare with transformers
    focus.py     the default sentences and which token of each to follow
    table.py     the terminal table: per layer and head, the word the followed token attends to most
    command.py   the command: a progress bar, the pictures (attnzero.viz), the tables, the summary

Needs the ``hf`` extra (``pip install -e ".[hf]"``); importing this package imports none of it.
"""

"""The sentences the demo reads by default, and which token of each sentence it follows."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_TEXTS = (
    "The animal didn't cross the street because it was too tired",
    # "I love the flowers on the mountain, and also love the moon in the river": the second 愛 has no
    # written subject — the Chinese counterpart of resolving "it". (MiniLM's English vocabulary has
    # only ~240 Chinese characters and no 它/他/她, so the sentence is made of characters it knows.)
    "我愛山上的花，也愛河中的月",
)
DEFAULT_FOCUS = ("it", "愛")


def choose(texts: Sequence[str] | None, focus: str | None) -> tuple[list[str], list[str | None]]:
    """The sentences to read and, per sentence, the word to follow (None: let :func:`focus_index`
    choose): ``focus`` for every sentence when given, else "it" / "愛" for the default sentences."""
    chosen = list(texts) if texts else list(DEFAULT_TEXTS)
    if focus:
        return chosen, [focus] * len(chosen)
    return chosen, list(DEFAULT_FOCUS) if not texts else [None] * len(chosen)


def focus_index(tokens: Sequence[str], word: str | None) -> int | None:
    """The last token equal to ``word`` (case-insensitive, ignoring '##'); without a word, the last
    "it", else the last token that is neither special nor punctuation. None when ``word`` is given
    and is not among the tokens."""
    def last(w: str) -> int | None:
        hits = [i for i, t in enumerate(tokens) if t.removeprefix("##").lower() == w.lower()]
        return hits[-1] if hits else None

    if word is not None:
        return last(word)
    it = last("it")
    if it is not None:
        return it
    words = [i for i, t in enumerate(tokens) if not is_special(t) and any(c.isalnum() for c in t)]
    return words[-1] if words else len(tokens) - 1


def is_special(token: str) -> bool:
    """[CLS], [SEP], [PAD], ...: the tokenizer's markers, not words of the sentence."""
    return token.startswith("[") and token.endswith("]")

"""Small helpers with no home of their own: no engine state, no torch."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: the blocks of ``b`` tokens that ``a`` tokens fill."""
    return -(-a // b)


def check_utf8(text: str, what: str = "prompt") -> None:
    """Raises: ValueError naming the first character with no UTF-8 encoding (a lone surrogate
    such as ``"\\ud800"``, which JSON can carry but no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text: character {exc.start} is the lone "
                         f"surrogate {text[exc.start]!r}") from None

"""The most text one token can stand for: a floor on a text's token count without tokenizing.

A 50 MB prompt took ~50 s and ~1.3 GB to tokenize before ``max_model_len`` could refuse it.
If no token stands for more than ``max_chars`` characters (``max_bytes`` bytes of UTF-8) of the
text, a text of C characters (B bytes) has at least ``max(ceil(C / max_chars), ceil(B /
max_bytes))`` tokens, provided the tokenizer's pipeline drops no text. Per piece:

- a vocabulary token of a byte-level BPE (GPT-2, SmolLM2, Qwen2) writes each byte of the text as
  one character (``'Ġthe'`` is ``' the'``): it stands for ``len(token)`` bytes, so at most that
  many characters. Elsewhere (SentencePiece-style BPE: Llama 2, Gemma 3) a token's characters are
  the text's, ``'▁'`` for a space (3 bytes of UTF-8 for 1) and ``'<0x41>'`` for one byte;
  ``len(token)`` characters and ``len(token.encode())`` bytes bound what it stands for;
- an added token (``<|im_start|>``) stands for its content; one with ``lstrip``/``rstrip``
  swallows any run of spaces next to it;
- an unknown character becomes one ``unk`` token (at most 4 bytes), unless ``fuse_unk`` merges
  a whole run of them into one; without ``unk`` or byte fallback it is dropped. A byte-level
  alphabet may lack bytes: SmolLM2's lacks the control characters U+0004, U+0006, U+0013,
  U+0014, U+0016 and U+001D (so ``"\\x04" * 10**6`` is 0 tokens), the lead bytes 0xF1 and
  0xF2 and bytes UTF-8 never uses (0xC0, 0xC1, 0xF5-0xFF). Such ASCII characters are counted
  out of the text (``dropped``); a character that loses its lead byte keeps its continuation
  bytes, so it still counts as a character, but the bytes floor is off;
- normalizers may shrink the text: NFC and NFKC compose at most 4 code points into one
  (U+0391 U+0314 U+0342 U+0345 -> U+1F8F), so each allows 4 times the characters; NFD, NFKD and
  lowercasing keep every character but may shrink bytes (U+212A KELVIN SIGN -> ``k``), so they
  turn the bytes floor off; ``Strip``, ``StripAccents``, regex replacements and the like drop
  text without bound;
- special tokens the post-processor adds (BOS) only add to the count.

Where the pipeline is one this cannot vouch for (a normalizer or pre-tokenizer that drops text,
``fuse_unk``, WordPiece or Unigram, a tokenizer without a Rust backend), the span is the
longest token times ``UNSOUND_FACTOR``: a guard against megabyte prompts, not a proof; only a
text that the tokenizer shrinks more than that many times could be refused wrongly.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.utils import cdiv

UNSOUND_FACTOR = 16
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_CHAR_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}

_cache: "weakref.WeakKeyDictionary[Any, Optional[TokenSpan]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TokenSpan:
    """The most text one token of a tokenizer stands for, slack for its normalizer included.

    Attributes:
        max_chars: characters (code points) per token.
        max_bytes: bytes of UTF-8 per token, or None where normalization may shrink bytes.
        sound: False where ``max_chars`` is the ``UNSOUND_FACTOR`` guard, not a proven bound.
        dropped: ASCII characters the tokenizer drops without a token (not counted).
    """

    max_chars: int
    max_bytes: Optional[int]
    sound: bool
    dropped: str = ""

    def min_tokens(self, text: str, limit: int) -> tuple[int, str]:
        """A floor on ``text``'s token count, exact enough to compare with ``limit``, and its
        reason (``"N characters"``). Cheapest first: ``len(text)`` alone settles most texts;
        the dropped characters are counted, and the text encoded for the bytes floor, only
        where the floor could pass ``limit``.

        A text that is not UTF-8 gets the characters floor; the caller's UTF-8 check refuses it.
        """
        num_chars = len(text)
        bytes_may_pass = self.max_bytes is not None and 4 * num_chars > self.max_bytes * limit
        if cdiv(num_chars, self.max_chars) <= limit and not bytes_may_pass:
            return cdiv(num_chars, self.max_chars), f"{num_chars} characters"
        num_dropped = sum(map(text.count, self.dropped))
        besides = f" besides {num_dropped} that the tokenizer drops" if num_dropped else ""
        by_chars = cdiv(num_chars - num_dropped, self.max_chars)
        if by_chars > limit or not bytes_may_pass:
            return by_chars, f"{num_chars - num_dropped} characters{besides}"
        try:
            num_bytes = len(text.encode("utf-8")) - num_dropped
        except UnicodeEncodeError:
            return by_chars, f"{num_chars - num_dropped} characters{besides}"
        by_bytes = cdiv(num_bytes, self.max_bytes)
        if by_bytes > by_chars:
            return by_bytes, f"{num_bytes} bytes of UTF-8{besides}"
        return by_chars, f"{num_chars - num_dropped} characters{besides}"

    def describe(self) -> str:
        per_token = f"{self.max_chars} characters"
        if self.max_bytes is not None:
            per_token += f" or {self.max_bytes} bytes"
        return f"no token of this tokenizer stands for more than {per_token}" + (
            "" if self.sound else " (a guard: its pipeline may drop text)")


def token_span(tokenizer: Any) -> Optional[TokenSpan]:
    """The span of a ``transformers`` tokenizer (computed once per tokenizer object), or None
    for one without a vocabulary to measure (a test's stand-in)."""
    try:
        return _cache[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: measure every time
        return _measure(tokenizer)
    span = _cache[tokenizer] = _measure(tokenizer)
    return span


def _measure(tokenizer: Any) -> Optional[TokenSpan]:
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pipeline = _pipeline(backend) if backend is not None else None
    byte_level = pipeline is not None and pipeline["byte_level"]
    max_chars, max_bytes = 1, 4  # an unknown character as one unk token
    for token_id, token in enumerate(tokens):
        if token_id in added:
            token = added[token_id].content
        if not token:
            continue
        max_chars = max(max_chars, len(token))
        max_bytes = max(max_bytes, len(token) if byte_level and token_id not in added else len(token.encode()))
    if pipeline is None or not pipeline["keeps_text"] or any(t.lstrip or t.rstrip for t in added.values()):
        return TokenSpan(max_chars * UNSOUND_FACTOR, None, sound=False)
    return TokenSpan(max_chars * pipeline["char_slack"], max_bytes if pipeline["keeps_bytes"] else None,
                     sound=True, dropped=pipeline["dropped"])


def _pipeline(backend: Any) -> dict:
    """What the Rust tokenizer's normalizer, pre-tokenizer and model do to the text's length."""
    normalizers = _steps(backend.normalizer, "normalizers")
    pre_tokenizers = _steps(backend.pre_tokenizer, "pretokenizers")
    byte_level = any(step["type"] == "ByteLevel" for step in pre_tokenizers)
    dropped, keeps_bytes = _dropped_characters(backend, byte_level)
    char_slack, keeps_text = 1, dropped is not None
    for step in normalizers:
        kind = step["type"]
        if kind in _COMPOSING_NORMALIZERS:
            char_slack *= 4
            keeps_bytes = False
        elif kind in _CHAR_KEEPING_NORMALIZERS:
            keeps_bytes = False
        elif kind == "Replace" and "String" in step["pattern"] and step["pattern"]["String"]:
            pattern, content = step["pattern"]["String"], step["content"]
            keeps_text &= len(content) >= len(pattern) and not set(content) & set(dropped or "")
            keeps_bytes &= len(content.encode()) >= len(pattern.encode())
        elif kind != "Prepend":
            keeps_text = False
    for step in pre_tokenizers:
        if step["type"] not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") == "Removed":
            keeps_text = False
    return {"byte_level": byte_level, "char_slack": char_slack, "keeps_text": keeps_text,
            "keeps_bytes": keeps_bytes, "dropped": dropped or ""}


def _steps(component: Any, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as its list of steps (a ``Sequence`` flattened)."""
    if component is None:
        return []
    stack, steps = [json.loads(component.__getstate__())], []
    while stack:
        step = stack.pop()
        if step["type"] == "Sequence":
            stack.extend(step[key])
        else:
            steps.append(step)
    return steps


def _dropped_characters(backend: Any, byte_level: bool) -> tuple[Optional[str], bool]:
    """``(characters, bytes kept)``: the characters a BPE drops without a token ("" when its
    byte fallback is complete or it writes one ``unk`` per unknown character; None when it may
    drop a character that is not ASCII, or is no BPE), and whether it keeps every byte of the
    others. A byte-level alphabet that lacks an ASCII byte drops that character; one that lacks
    a lead byte of a longer character (SmolLM2: 0xF1, 0xF2) keeps its continuation bytes."""
    model = backend.model
    if type(model).__name__ != "BPE":
        return None, False
    if model.byte_fallback and all(backend.token_to_id(f"<0x{b:02X}>") is not None for b in range(256)):
        return "", True
    if model.unk_token is not None and not model.fuse_unk:
        return "", True
    if not byte_level:
        return None, False
    missing = [byte for byte, char in enumerate(_byte_level_chars()) if backend.token_to_id(char) is None]
    reachable = [byte for byte in missing if not (byte in (0xC0, 0xC1) or byte >= 0xF5)]
    if any(0x80 <= byte < 0xC0 for byte in reachable):
        return None, False
    return "".join(chr(byte) for byte in reachable if byte < 0x80), all(byte < 0x80 for byte in reachable)


def _byte_level_chars() -> list[str]:
    """GPT-2's ``bytes_to_unicode``, the character that stands for each byte: printable
    Latin-1 bytes for themselves, the 68 others U+0100 onwards in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, num_shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(0x100 + num_shifted))
            num_shifted += 1
    return chars

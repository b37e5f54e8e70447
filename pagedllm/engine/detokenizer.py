"""Incremental detokenization and stop strings for one sequence.

Mirrors vLLM's ``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``)
and the v1 ``IncrementalDetokenizer`` (``vllm/v1/engine/detokenizer.py``): each new token is
decoded together with a few tokens before it, from ``prefix_offset``, and only the text past
the already emitted part (tokens up to ``read_offset``) is appended, so a step costs a few
tokens whatever the length of the sequence, and tokenizers whose decoding depends on the
neighbours (SentencePiece leading spaces, byte-level BPE characters split across tokens) come
out right. While the decoded window ends in U+FFFD, a multi-byte UTF-8 character is
incomplete: nothing is emitted until a later token completes it, or until ``flush`` at the end.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedllm.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first generated token (vLLM's
# ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).
_INITIAL_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The growing text of one sequence, cut at stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``,
            ``convert_tokens_to_string``).
        prompt_token_ids: the prompt; its last tokens give the first generated token context.
        params: ``skip_special_tokens``, ``stop``, ``include_stop_str_in_output`` and
            ``min_tokens`` are used.

    Invariants: ``output_text`` only grows except when a stop string cuts it, and never below
    what ``get_next_output_text`` has handed out (held-back text covers any possible cut).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.vocab_size = len(tokenizer)
        self.special_ids: frozenset[int] = frozenset()
        if self.skip_special_tokens:
            # The added tokens flagged special are what ``decode(skip_special_tokens=True)``
            # drops; ``all_special_ids`` can list fewer of them.
            decoder = getattr(tokenizer, "added_tokens_decoder", {})
            self.special_ids = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))
            self.special_ids |= frozenset(tokenizer.all_special_ids)
        context = self._to_tokens(list(prompt_token_ids)[-(_INITIAL_OFFSET + 2):])
        self.tokens: list[str] = context
        self.prefix_offset = max(len(context) - _INITIAL_OFFSET, 0)
        self.read_offset = len(context)
        self.output_text = ""
        self.num_output_tokens = 0
        self.num_sent_chars = 0

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        kept = [t for t in token_ids if 0 <= t < self.vocab_size and t not in self.special_ids]
        return self.tokenizer.convert_ids_to_tokens(kept) if kept else []

    def _decode_window(self) -> tuple[str, str]:
        prefix_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset:])
        return prefix_text, new_text

    def _decode_next(self, token_id: int) -> str:
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:
            return ""
        self.tokens.extend(new_tokens)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text):]

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> Optional[str]:
        """Decode new tokens and look for stop strings in the new text.

        Args:
            new_token_ids: tokens generated since the last call.
            stop_terminated: the last token is an EOS or stop token that ended the sequence;
                its text is left out unless ``include_stop_str_in_output``.

        Returns:
            The stop string found (``output_text`` is then cut: before it, or after it with
            ``include_stop_str_in_output``), or None. Stop strings count only once more than
            ``min_tokens`` tokens were generated (vLLM's rule).
        """
        last = len(new_token_ids) - 1
        for index, token_id in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if index == last and stop_terminated and not self.include_stop_str_in_output:
                break
            delta = self._decode_next(token_id)
            if not delta:
                continue
            self.output_text += delta
            if self.stop and self.num_output_tokens > self.min_tokens:
                stop = self._cut_at_stop_string(len(delta))
                if stop is not None:
                    return stop
        return None

    def flush(self) -> None:
        """At the end of the sequence: append what was held back as an incomplete UTF-8
        character (it decodes with U+FFFD, as ``tokenizer.decode`` would)."""
        if self.read_offset < len(self.tokens):
            prefix_text, new_text = self._decode_window()
            self.output_text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)

    def _cut_at_stop_string(self, num_new_chars: int) -> Optional[str]:
        """Find the earliest stop string that ends in the last ``num_new_chars`` characters
        (it may start earlier, across tokens, or lie inside one token); cut the text there."""
        text = self.output_text
        found: Optional[tuple[int, str]] = None
        for stop in self.stop:
            index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.output_text = text[:index + len(stop)] if self.include_stop_str_in_output else text[:index]
        return stop

    def _held_back_length(self) -> int:
        """Characters at the end of the text that could be the start of a stop string: the
        longest suffix that is a proper prefix of one of them. It is released as soon as the
        next text makes it impossible."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        text = self.output_text
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now.

        Args:
            finished: the sequence ended (nothing is held back any more).
            delta: return only the text not returned before (streaming ``DELTA`` mode);
                otherwise all of it up to the held-back tail.
        """
        length = len(self.output_text)
        if not finished:
            length -= self._held_back_length()
        length = max(length, self.num_sent_chars)
        start = self.num_sent_chars if delta else 0
        self.num_sent_chars = length
        return self.output_text[start:length]

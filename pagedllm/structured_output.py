"""Structured outputs: compile a constraint, track it per sequence, mask the logits.

The backend is llguidance (``llguidance==1.9.1``, one of vLLM's two backends; vLLM's
``vllm/v1/structured_output/backend_guidance.py`` plays the same role). Measured on this
project's CPU against xgrammar 0.2.8 (bench/README.md, "Structured outputs"): llguidance
compiles a JSON schema in ~1-13 ms where xgrammar takes 0.3-0.65 s (it precomputes masks),
and both fill a 49k-token mask in tens of microseconds per token; xgrammar also pulls in
triton (~286 MB, GPU only) as a dependency.

Three pieces, one per place they are used:

- ``GrammarCompiler`` (any thread): ``StructuredOutputsParams`` -> ``CompiledGrammar``,
  checked (a bad schema, regex or grammar is a ``ValueError`` naming the problem) and cached
  by ``(kind, spec)``. The server compiles in a worker thread before the request reaches the
  engine thread, so no step waits for a compile.
- ``GrammarState`` (engine thread, on the ``Request``): one matcher per sequence, advanced by
  each sampled token (``Scheduler._append_token``), never by recompute after preemption,
  since the generated tokens are kept and not sampled again.
- ``fill_bitmasks`` and ``apply_token_bitmask`` (the sampler): the next-token masks of the
  constrained rows, then one masked fill of the ``[rows, vocab]`` logits before temperature,
  top-k and top-p.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from pagedllm.sampling_params import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first); a schema is a few KB of matcher.
GRAMMAR_CACHE_SIZE = 256

# Row ``b``: which of the 8 tokens of a mask byte with value ``b`` are forbidden (1) or not
# (0). The mask is little-endian 32-bit words, token ``t`` being bit ``t % 32`` of word
# ``t // 32``, so byte ``j`` of word ``i`` holds tokens ``32 i + 8 j + k``, bit ``k``.
_BYTE_FORBIDDEN = (((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0).to(torch.uint8)

class CompiledGrammar:
    """A checked constraint, ready to start sequences on (shared, never advanced itself).

    Attributes:
        key: ``(kind, spec)`` of the ``StructuredOutputsParams`` it came from.
    """

    def __init__(self, key: tuple[str, str], matcher: Any) -> None:
        self.key = key
        self._matcher = matcher
        self.broken = False  # a state of it failed: its copies share the failed lexer

    def new_state(self) -> "GrammarState":
        """A fresh per-sequence state at the start of the constraint."""
        return GrammarState(self._matcher.deep_copy(), self)


class GrammarState:
    """One sequence's position in its constraint (an llguidance ``LLMatcher``).

    llguidance builds the lexer of a regex lazily, while masks are computed, and gives up past
    its limits ("too many expressions constructed", e.g. ``a{1000}{1000}``): the matcher is then
    in error and allows only EOS. Such a sequence must end as an error, not as a completed
    constraint, and the grammar must be compiled afresh for the next request (copies of a
    matcher share its lexer, so every later state of it starts in error).
    """

    def __init__(self, matcher: Any, grammar: CompiledGrammar) -> None:
        self.matcher = matcher
        self.grammar = grammar

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the constraint forbids it or its matcher is
        in error (the state then accepts nothing more; ``error`` says why)."""
        return self.matcher.consume_token(token_id) and self.error is None

    @property
    def error(self) -> "str | None":
        """llguidance's message when the matcher failed (and its grammar is marked broken)."""
        if not self.matcher.is_error():
            return None
        self.grammar.broken = True
        return self.matcher.get_error().strip().splitlines()[0]

    @property
    def is_terminated(self) -> bool:
        """True when the constraint is complete and allows no further token."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def fork(self, num_rollback: int = 0) -> "GrammarState":
        """A copy for another sequence (beam search's ``fork_request``), with the last
        ``num_rollback`` accepted tokens undone."""
        matcher = self.matcher.deep_copy()
        if num_rollback:
            matcher.rollback(num_rollback)
        return GrammarState(matcher, self.grammar)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; thread-safe.

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's logits width (tokens); may exceed the tokenizer's vocabulary
            (padding rows of the embedding), and those ids are never allowed.

    The llguidance view of the tokenizer (~0.5 s to build for a 49k vocabulary) is made on the
    first compile, so an engine that never sees a constraint never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, from the cache when the same ``(kind, spec)`` was seen.

        Raises:
            ValueError: the schema, regex or grammar does not compile (llguidance's message:
                an unknown type, an unresolvable ``$ref``, an unsupported regex feature such as
                look-around, an unknown rule...), or there is no tokenizer.
        """
        import llguidance

        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None and not compiled.broken:
                self._cache.move_to_end(key)
                return compiled
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("structured_outputs needs a tokenizer; this engine has none")
                import llguidance.hf
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        grammar = _to_llguidance_grammar(params)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error().strip()}")
        compiled = CompiledGrammar(key, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def check_json_schema(schema: Any, field: str) -> None:
    """Whether llguidance compiles ``schema`` (as ``compile`` would, without a tokenizer).

    Raises:
        ValueError: it does not (an unknown type, an unresolvable ``$ref``...), the message
            starting with ``field``.
    """
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"{field} is not a JSON schema that compiles: {error.strip()}")


def _to_llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (vLLM ``serialize_guidance_grammar``)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.kind
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    if kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(params.json, defaults=options)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is invalid: {exc}") from None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any choice text is spelled exactly.
        options = " | ".join(json.dumps(option, ensure_ascii=False) for option in params.choice)
        return LLMatcher.grammar_from_lark(f"start: {options}")
    try:
        lark = any_to_lark(params.grammar)
    except Exception as exc:  # noqa: BLE001 - the GBNF converter raises its own error types
        raise ValueError(f"structured_outputs.grammar is invalid: {exc}") from None
    return LLMatcher.grammar_from_lark(lark)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(vocab_size / 32)]`` int32, all tokens forbidden."""
    return torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32)


def fill_bitmasks(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
    """Write each state's allowed next tokens into ``bitmask[i]`` (``[len(states), words]``
    int32, C-contiguous).

    One row after the other: 64 rows of a JSON schema take 0.5-0.9 ms here, while
    llguidance's thread pool (``fill_next_token_bitmask_par``) took 1-30 ms on this shared
    2-core machine (bench/README.md, "Structured outputs").
    """
    import llguidance.torch

    for row, state in enumerate(states):
        llguidance.torch.fill_next_token_bitmask(state.matcher, bitmask, row)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the forbidden tokens of the constrained rows to -inf, for all rows at once.

    Args:
        logits: ``[batch, vocab]`` float, modified in place.
        rows: ``[n]`` int64, the constrained rows of ``logits``, ascending.
        bitmask: ``[n, ceil(vocab / 32)]`` int32 from ``fill_bitmasks``; bit ``t`` set means
            token ``t`` is allowed.

    Returns:
        ``logits``.
    """
    vocab = logits.shape[1]
    # One table lookup per mask byte (an embedding gather) beats shifting 32 bits per word.
    forbidden = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_FORBIDDEN)
    forbidden = forbidden.view(len(rows), -1)[:, :vocab].view(torch.bool)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill_(forbidden, float("-inf"))
    logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
    return logits

"""The incremental detokenizer on the real SmolLM2 tokenizer: deltas against
``tokenizer.decode``, UTF-8 hold-back, stop strings and their streaming hold-back."""

from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.models.loader import load_tokenizer, resolve_model_path

TEXTS = ["你好,世界!今天天气很好。🙂🎉 naïve café", "Ünïcödé ✓ → 日本語のテキスト 😀👍🏽",
         "The quick brown fox jumps over the lazy dog. " * 2, "def f(x):\n    return x ** 2  # ½"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def stream(tokenizer, prompt_ids, token_ids, params, stop_terminated=False):
    """Feed tokens one by one in DELTA mode; returns (deltas, stop string, detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stop = [], None
    for index, token_id in enumerate(token_ids):
        last = index == len(token_ids) - 1
        stop = detokenizer.update([token_id], stop_terminated and last)
        finished = stop is not None or last
        if finished and stop is None:
            detokenizer.flush()
        deltas.append(detokenizer.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return deltas, stop, detokenizer


def test_deltas_join_to_decode_on_random_and_multibyte_sequences(tokenizer):
    rng = random.Random(0)
    prompt = tokenizer.encode("Écris en chinois : 你好")
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 25))]
        else:
            ids = tokenizer.encode(rng.choice(TEXTS))
            ids = ids[rng.randrange(len(ids)):]  # may start in the middle of a character
        skip = trial % 4 < 2
        deltas, _, _ = stream(tokenizer, prompt, ids, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_b21_incomplete_utf8_is_held_back_then_completed_or_flushed(tokenizer):
    ids = tokenizer.encode("你好🙂")
    # Byte-level BPE splits these characters over several tokens.
    assert len(ids) > 3
    deltas, _, _ = stream(tokenizer, [1], ids, SamplingParams())
    assert "\ufffd" not in "".join(deltas) and "".join(deltas) == "你好🙂"
    for delta in deltas:
        assert delta in ("", "你", "好", "🙂", "你好")
    # A sequence that ends inside a character is flushed at the end, as decode renders it.
    deltas, _, _ = stream(tokenizer, [1], ids[:-1], SamplingParams())
    assert deltas[-1].endswith("\ufffd") and "".join(deltas) == tokenizer.decode(ids[:-1])
    assert "\ufffd" not in "".join(deltas[:-1])


def test_stop_token_text_is_left_out_unless_included(tokenizer):
    ids = tokenizer.encode("Hello there") + [tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    deltas, _, _ = stream(tokenizer, [1], ids, params, stop_terminated=True)
    assert "".join(deltas) == "Hello there"
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    deltas, _, _ = stream(tokenizer, [1], ids, params, stop_terminated=True)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_b20_stop_string_inside_one_token(tokenizer):
    ids = tokenizer.encode("I live in Amsterdam today")
    whole = [i for i in ids if tokenizer.decode([i]) == " Amsterdam"]
    assert whole, "the test needs ' Amsterdam' to be one token"
    for include, expected in ((False, "I live in Am"), (True, "I live in Amst")):
        params = SamplingParams(stop=["st"], include_stop_str_in_output=include)
        deltas, stop, detokenizer = stream(tokenizer, [1], ids, params)
        assert stop == "st" and "".join(deltas) == expected == detokenizer.output_text


def test_stop_string_across_tokens_earliest_match_wins(tokenizer):
    ids = tokenizer.encode("one two three four five")
    params = SamplingParams(stop=["four", "o thr", "zzz"])
    deltas, stop, _ = stream(tokenizer, [1], ids, params)
    assert stop == "o thr" and "".join(deltas) == "one tw"
    params = SamplingParams(stop=["four"], min_tokens=len(ids))
    deltas, stop, _ = stream(tokenizer, [1], ids, params)
    assert stop is None and "".join(deltas) == "one two three four five"


def test_b19_streaming_holds_back_only_possible_stop_prefixes(tokenizer):
    text = "A B C D E F G H I J"
    ids = tokenizer.encode(text)
    stop = "F G H"
    deltas, found, _ = stream(tokenizer, [1], ids, SamplingParams(stop=[stop]))
    assert found == stop and "".join(deltas) == "A B C D E "
    streamed = ""
    for delta in deltas:
        streamed += delta
        # Nothing of the stop string leaks, and only a possible beginning of it is held back.
        assert "F" not in streamed
    # A false start ("D E X" vs stop "D E F") is released as soon as it cannot match.
    ids = tokenizer.encode("A B D E X Y")
    deltas, found, detokenizer = stream(tokenizer, [1], ids, SamplingParams(stop=["D E F"]))
    assert found is None and "".join(deltas) == "A B D E X Y"
    cumulative = [("".join(deltas[:i + 1])) for i in range(len(deltas))]
    pieces = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    for sent, full in zip(cumulative, pieces):
        # Held back: exactly the longest end of the text that begins "D E F".
        longest = max(size for size in range(len("D E F")) if full.endswith("D E F"[:size]))
        assert full.startswith(sent) and len(full) - len(sent) == longest, (sent, full)

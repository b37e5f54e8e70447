"""The throughput benchmark's workload: fixed by its seed, lengths in range, prompts cut from the text."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.throughput import TEXT_PATH, build_workload


class WordTokenizer:
    """One token per whitespace-separated word (ids = index into the sorted vocabulary)."""

    def __init__(self) -> None:
        self.vocab = {w: i for i, w in enumerate(sorted(set(TEXT_PATH.read_text().split())))}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [self.vocab[w] for w in text.split()]


def test_workload_is_seeded_in_range_and_cut_from_the_text():
    tokenizer = WordTokenizer()
    stream = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    assert len(stream) > 3000
    workload = build_workload(tokenizer, num_requests=64, seed=0)
    assert len(workload) == 64
    assert all(32 <= len(r.prompt_token_ids) <= 512 and 32 <= r.output_len <= 256 for r in workload)
    doubled = stream + stream  # a prompt may wrap around the end of the text
    for request in workload:
        prompt = request.prompt_token_ids
        starts = [i for i in range(len(stream)) if doubled[i:i + len(prompt)] == prompt]
        assert starts, "prompt is not a contiguous (cyclic) slice of the text"
    again = build_workload(tokenizer, num_requests=64, seed=0)
    assert [(r.prompt_token_ids, r.output_len) for r in again] == \
        [(r.prompt_token_ids, r.output_len) for r in workload]
    other = build_workload(tokenizer, num_requests=64, seed=1)
    assert [r.output_len for r in other] != [r.output_len for r in workload]


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_requests=0), "num_requests must be >= 1, got 0"),
    (dict(prompt_len_range=(0, 5)), r"prompt_len_range must satisfy 1 <= min <= max, got \(0, 5\)"),
    (dict(output_len_range=(9, 3)), r"output_len_range must satisfy 1 <= min <= max, got \(9, 3\)"),
])
def test_workload_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_workload(WordTokenizer(), **kwargs)

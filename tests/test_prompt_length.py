"""A prompt too long for ``max_model_len`` is refused before it is tokenized (found by a user:
a 50 MB prompt took ~50 s and ~1.3 GB of tokenizing on the event loop, stalling every other
request, before its 400). The floor on a text's token count (``engine/token_span.py``) never
passes the real count, so it refuses nothing that fits; over it, the Python API raises and
the server answers OpenAI's 400 in milliseconds, and keeps serving.
"""

from __future__ import annotations

import functools
import re
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import EngineArgs
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.token_span import UNSOUND_FACTOR, TokenSpan, token_span
from pagedllm.models.registry import NAMED_MODELS
from pagedllm.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.test_server import InThreadServer, smollm2_tokenizer, tiny_chat_engine

MAX_MODEL_LEN = 64
SMOLLM2_LONGEST = "\n" + " " * 80  # SmolLM2's longest token, 81 characters
# Exactly MAX_MODEL_LEN - 1 tokens in exactly 81 * (MAX_MODEL_LEN - 1) characters: the floor is tight.
WIDEST_FITTING = SMOLLM2_LONGEST * (MAX_MODEL_LEN - 1)


def limit_error(num_chars: int, min_tokens: int, what: str = "prompt") -> str:
    return (f"the {what} text has {num_chars} characters, so at least {min_tokens} tokens (no token of "
            f"this tokenizer stands for more than 81 characters), but max_model_len is {MAX_MODEL_LEN} "
            f"(the KV cache holds 256 tokens: 64 blocks of 4) and at least one token must be generated: "
            f"the prompt may have at most {MAX_MODEL_LEN - 1} tokens")


def engine_args() -> EngineArgs:
    return EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=16, max_num_batched_tokens=64)


@functools.lru_cache(maxsize=None)
def installed_tokenizer(name: str):
    from pagedllm.models.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(name))


@functools.lru_cache(maxsize=None)
def byte_fallback_tokenizer():
    """A SentencePiece-style BPE (Llama 2, Gemma 3): spaces as '▁', byte fallback."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "▁": 257, "a": 258, "▁a": 259,
             "aa": 260, "aaaa": 261, "▁aaaa": 262, "é": 263}
    merges = [("a", "a"), ("aa", "aa"), ("▁", "a"), ("▁", "aaaa")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>",
                                     fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


# Pieces that make the longest tokens (long whitespace runs), characters the tokenizers drop
# or normalize, special tokens, and multi-byte text, repeated.
PIECES = [SMOLLM2_LONGEST, " " * 127, "\n" * 31, " ", "\n", "a", " aaaa", "hello", "日本語", "🙂",
          "\x04", "\x1d", "<|im_start|>", "<bos>", "e\u0301", "\u0391\u0314\u0342\u0345", "\ufb01",
          "\u212a", "▁", "\U00040000", "é"]
texts = st.one_of(
    st.lists(st.tuples(st.sampled_from(PIECES), st.integers(1, 40)), max_size=12).map(
        lambda runs: "".join(piece * count for piece, count in runs)),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=300),
)
TOKENIZERS = [
    pytest.param(smollm2_tokenizer, id="smollm2"),
    pytest.param(byte_fallback_tokenizer, id="byte-fallback"),
    *[pytest.param(functools.partial(installed_tokenizer, name), id=name,
                   marks=pytest.mark.skipif(not NAMED_MODELS[name].is_installed(), reason=f"{name} not installed"))
      for name in ("qwen2.5-coder-0.5b", "gemma-3-270m")],
]


# --------------------------------------------------------------------------------- the floor
def test_smollm2_span_is_its_longest_token_less_the_control_characters_it_drops():
    tokenizer = smollm2_tokenizer()
    assert token_span(tokenizer) == TokenSpan(81, None, sound=True, dropped="\x04\x06\x13\x14\x16\x1d")
    assert tokenizer.encode(SMOLLM2_LONGEST) == tokenizer.encode(SMOLLM2_LONGEST)[:1]
    assert tokenizer.encode("\x04" * 1000) == []  # why they are counted out


@pytest.mark.parametrize("make_tokenizer", TOKENIZERS)
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(text=texts)
def test_the_floor_never_passes_the_real_token_count(make_tokenizer, text):
    tokenizer = make_tokenizer()
    span = token_span(tokenizer)
    assert span.sound
    min_tokens, _ = span.min_tokens(text, 0)  # limit 0: every floor is computed
    assert min_tokens <= len(tokenizer.encode(text, add_special_tokens=False))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(text=texts, max_model_len=st.integers(2, 40))
def test_the_input_processor_refuses_only_text_that_cannot_fit(text, max_model_len):
    from pagedllm.engine.stats import ModelInfo
    tokenizer = smollm2_tokenizer()
    processor = InputProcessor(ModelInfo(model=None, max_model_len=max_model_len, vocab_size=len(tokenizer),
                                         eos_token_id=None, tokenizer=tokenizer, block_size=4, num_blocks=64,
                                         max_num_seqs=4, max_num_batched_tokens=64))
    try:
        processor.check_text_length(text)
    except ValueError as exc:
        assert f"max_model_len is {max_model_len}" in str(exc)
        assert len(tokenizer.encode(text)) > max_model_len - 1


def test_pipelines_that_may_drop_text_get_the_guard_not_a_proof():
    from tokenizers import AddedToken, Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    def span(tokenizer: Tokenizer) -> TokenSpan:
        return token_span(PreTrainedTokenizerFast(tokenizer_object=tokenizer))

    def bpe(**kwargs) -> Tokenizer:
        return Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1, "aaaa": 2}, merges=[], **kwargs))

    stripping = bpe(unk_token="<unk>")
    stripping.normalizer = normalizers.Strip()
    assert span(stripping) == TokenSpan(5 * UNSOUND_FACTOR, None, sound=False)
    assert span(bpe(unk_token="<unk>", fuse_unk=True)) == TokenSpan(5 * UNSOUND_FACTOR, None, sound=False)
    assert span(bpe()).sound is False  # no unk: unknown characters vanish
    swallowing = bpe(unk_token="<unk>")
    swallowing.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert span(swallowing) == TokenSpan(6 * UNSOUND_FACTOR, None, sound=False)
    composing = bpe(unk_token="<unk>")
    composing.normalizer = normalizers.NFC()
    assert span(composing) == TokenSpan(5 * 4, None, sound=True)  # 4 code points compose into 1
    assert span(bpe(unk_token="<unk>")) == TokenSpan(5, 5, sound=True)
    assert token_span(None) is None


# --------------------------------------------------------------------------------- Python API
def test_engine_refuses_text_over_the_floor_at_once_and_takes_text_at_it():
    engine = tiny_chat_engine(engine_args())
    start = time.monotonic()
    for text in ["a" * 50_000_000, WIDEST_FITTING + " "]:
        with pytest.raises(ValueError, match=f"^{re.escape(limit_error(len(text), -(-len(text) // 81)))}$"):
            engine.add_request("big", text, SamplingParams(max_tokens=1))
    assert time.monotonic() - start < 2.0  # tokenizing the 50 MB took ~50 s
    with pytest.raises(ValueError, match="besides 1000000 that the tokenizer drops, so at least 64 tokens"):
        engine.add_request("big", "\x04" * 1_000_000 + WIDEST_FITTING + " ", SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()

    assert len(smollm2_tokenizer().encode(WIDEST_FITTING)) == MAX_MODEL_LEN - 1
    engine.add_request("widest", WIDEST_FITTING, SamplingParams(max_tokens=1))
    engine.add_request("dropped", "\x04" * 100_000 + "hello", SamplingParams(max_tokens=1))
    outputs = run_to_completion(engine)
    assert len(outputs["widest"].prompt_token_ids) == MAX_MODEL_LEN - 1
    assert len(outputs["widest"].outputs[0].token_ids) == 1
    assert len(outputs["dropped"].prompt_token_ids) == 1


def test_llm_chat_refuses_a_conversation_over_the_floor():
    from pagedllm import LLM
    llm = LLM.__new__(LLM)
    llm.llm_engine = tiny_chat_engine(engine_args())
    with pytest.raises(ValueError, match=r"^the messages text has \d+ characters, so at least \d+ tokens .*"
                                         r"max_model_len is 64"):
        llm.encode_chat([{"role": "user", "content": "a" * 1_000_000}])


# --------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server():
    with InThreadServer(tiny_chat_engine(engine_args())) as server:
        yield server


def error(message: str, param=None) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def test_server_answers_400_at_once_and_keeps_serving(server):
    huge = "a" * 5_000_000
    min_tokens = -(-len(huge) // 81)
    cases = [
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}, error(limit_error(len(huge), min_tokens))),
        ("/v1/completions", {"prompt": ["fine", huge], "max_tokens": 2}, error(limit_error(len(huge), min_tokens))),
        ("/v1/completions", {"prompt": WIDEST_FITTING + " ", "max_tokens": 1, "stream": True},
         error(limit_error(len(WIDEST_FITTING) + 1, MAX_MODEL_LEN))),
        ("/tokenize", {"prompt": huge}, error(limit_error(len(huge), min_tokens), "prompt")),
    ]
    for path, body, expected in cases:
        start = time.monotonic()
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert time.monotonic() - start < 5.0
        assert response.status_code == 400 and response.json() == expected
    for path in ("/v1/chat/completions", "/tokenize"):
        response = httpx.post(server.url + path, json={"messages": [{"role": "user", "content": huge}]},
                              timeout=30)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert message.startswith("the messages text has ") and "max_model_len is 64" in message
        assert response.json()["error"]["param"] == "messages"

    response = httpx.post(server.url + "/v1/completions", json={"prompt": WIDEST_FITTING, "max_tokens": 1},
                          timeout=30)
    assert response.json()["usage"] == {"prompt_tokens": 63, "completion_tokens": 1, "total_tokens": 64}
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert response.json()["usage"]["completion_tokens"] == 2


def test_server_tokenizes_off_the_event_loop(server, monkeypatch):
    """A slow tokenization (a prompt near a large ``max_model_len``) holds only its own request."""
    tokenize = InputProcessor.tokenize

    def slow_tokenize(self, prompt, truncate=None):
        if isinstance(prompt, str):
            time.sleep(2.0)
        return tokenize(self, prompt, truncate)
    monkeypatch.setattr(InputProcessor, "tokenize", slow_tokenize)
    slow = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                            kwargs={"json": {"prompt": "hi", "max_tokens": 1}, "timeout": 30})
    slow.start()
    time.sleep(0.3)
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
    assert response.status_code == 200 and time.monotonic() - start < 1.0
    slow.join()

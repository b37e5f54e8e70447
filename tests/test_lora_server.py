"""LoRA over the OpenAI server (docs/lora.md): adapters selected by ``model``, listed by
``/v1/models`` with their parent, loaded and unloaded at runtime, limited per API key, and
``vllm:lora_requests_info``. Outputs are compared with transformers + PEFT greedy (fp32)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import SchedulerStats
from pagedllm.entrypoints.openai.api_keys import APIKey, parse_api_keys
from pagedllm.entrypoints.openai.cli_args import ServerArgs, parse_lora_modules
from pagedllm.lora import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.models.loader import build_model
from tests.conftest import tiny_state_dict
from tests.lora_adapters import adapters_and_references, make_adapter
from tests.test_lora import hf_tiny_model
from tests.test_server import MODEL, InThreadServer, scrape, smollm2_tokenizer, tiny_chat_config, tiny_chat_engine

pytest.importorskip("peft", reason="peft (the test extra) makes the adapters and the reference")

MAX_TOKENS = 8
PROMPT = [1, 504, 2184, 314, 7110, 28, 4114, 314]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    config = tiny_chat_config()
    root = tmp_path_factory.mktemp("lora_server")
    specs = [dict(rank=8, seed=5, target_modules=["q_proj", "v_proj", "down_proj"]),
             dict(rank=16, seed=6, target_modules=["o_proj", "gate_proj", "up_proj"])]
    paths, references = adapters_and_references(hf_tiny_model(0, config), root, specs, [PROMPT], MAX_TOKENS)
    make_adapter(hf_tiny_model(0, config), root / "dora", rank=8, seed=7, target_modules=["q_proj"], use_dora=True)
    tokenizer = smollm2_tokenizer()
    texts = [tokenizer.decode(tokens[0]) for tokens in references]
    assert len(set(texts)) == len(texts)  # each adapter changes the output
    return paths, texts, root / "dora"


def lora_server(paths, api_keys=(), **engine_options) -> InThreadServer:
    config = tiny_chat_config()
    model = build_model(config, tiny_state_dict(config), torch.float32)
    options = dict(block_size=16, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=8,
                   max_num_batched_tokens=256, enable_lora=True, max_loras=2, max_lora_rank=16) | engine_options
    engine = LLMEngine(EngineArgs.from_kwargs(**options), model=model, tokenizer=smollm2_tokenizer())
    lora_modules = [f"a0={paths[0]}"]
    for lora_request in ServerArgs(lora_modules=lora_modules).lora_requests():  # as the server's ids
        engine.add_lora(lora_request)
    return InThreadServer(engine, app_kwargs=dict(lora_modules=lora_modules, allow_runtime_lora_updating=True,
                                                  api_keys=list(api_keys)))


def complete(url: str, model: str, headers=None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "ignore_eos": True},
                      headers=headers, timeout=60)


def text_of(response: httpx.Response) -> str:
    body = response.json()
    assert response.status_code == 200, body
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    return body["choices"][0]["text"]


def test_adapters_by_model_name_models_list_and_runtime_loading(adapters):
    paths, references, dora = adapters
    with lora_server(paths) as server:
        url = server.url
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            (MODEL, None, MODEL), ("a0", MODEL, str(paths[0]))]
        response = complete(url, "a0")
        assert response.json()["model"] == "a0"
        assert text_of(response) == references[0]
        assert text_of(complete(url, MODEL)) == references[-1]
        assert complete(url, "a1").status_code == 404
        # Runtime loading (vLLM's endpoints and messages).
        load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths[1])})
        assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'a1' added successfully.")
        assert text_of(complete(url, "a1")) == references[1]
        again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths[1])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        refused = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(dora)})
        assert refused.status_code == 400 and "DoRA" in refused.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [MODEL, "a0", "a1"]
        unload = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'a1' removed successfully.")
        assert complete(url, "a1").status_code == 404
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 404
        # Loaded again: a new id, so the prefix cache cannot hand it the old one's blocks.
        httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths[1])})
        assert text_of(complete(url, "a1")) == references[1]
        # vLLM's load_inplace replaces it (a new user's try: it was "already loaded"); a refused
        # replacement keeps the old one; the base model's name is not an adapter's.
        body = {"lora_name": "a1", "lora_path": str(paths[0]), "load_inplace": True}
        replaced = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert (replaced.status_code, replaced.text) == (200, "Success: LoRA adapter 'a1' replaced successfully.")
        assert text_of(complete(url, "a1")) == references[0]
        refused = httpx.post(url + "/v1/load_lora_adapter", json={**body, "lora_path": str(dora)})
        assert refused.status_code == 400 and "DoRA" in refused.json()["error"]["message"]
        assert text_of(complete(url, "a1")) == references[0]
        base = httpx.post(url + "/v1/load_lora_adapter", json={**body, "lora_name": MODEL})
        assert base.status_code == 400 and "is the base model's name" in base.json()["error"]["message"]
        metrics = scrape(url)
        assert metrics['vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'] \
            <= time.time()


def test_api_key_limited_to_adapters(adapters):
    paths, references, _ = adapters
    keys = parse_api_keys('[{"name": "team-a", "key": "sk-a", "lora_adapters": ["a0"]},'
                          ' {"name": "ops", "key": "sk-ops"}]', "test")
    assert keys[0].lora_adapters == frozenset({"a0"}) and keys[1].lora_adapters is None
    with lora_server(paths, api_keys=keys) as server:
        url, team, ops = server.url, {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-ops"}
        load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths[1])},
                          headers=team)
        assert load.status_code == 403
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths[1])},
                          headers=ops).status_code == 200
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=team).json()["data"]] == [MODEL, "a0"]
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=ops).json()["data"]] == [MODEL, "a0", "a1"]
        assert text_of(complete(url, "a0", team)) == references[0]
        hidden = complete(url, "a1", team)
        assert hidden.status_code == 404 and "a1" not in hidden.json()["error"]["message"].split("serves")[1]
        assert text_of(complete(url, "a1", ops)) == references[1]


def test_lora_requests_info_gauge():
    """The gauge's labels from a snapshot: running and waiting adapters by name, max_lora."""
    import dataclasses

    from pagedllm.engine.stats import ModelInfo

    model_info = ModelInfo(model=None, max_model_len=64, vocab_size=10, eos_token_id=None, tokenizer=None,
                           block_size=4, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, max_loras=3)
    metrics = EngineMetrics("m", 64, 4, 64, model_info=model_info)
    before = time.time()
    metrics.update_gauges(SchedulerStats(running_lora_adapters=(("a", 2), ("b", 1)),
                                         waiting_lora_adapters=(("c", 1),)))
    samples = {tuple(sorted(s.labels.items())): s.value for family in metrics.registry.collect()
               if family.name == "vllm:lora_requests_info" for s in family.samples}
    ((labels, value),) = samples.items()
    assert labels == (("max_lora", "3"), ("running_lora_adapters", "a,b"), ("waiting_lora_adapters", "c"))
    assert before <= value <= time.time()
    without_lora = dataclasses.replace(model_info, max_loras=0)
    assert not any(f.name == "vllm:lora_requests_info"
                   for f in EngineMetrics("m", 64, 4, 64, model_info=without_lora).registry.collect())


def test_lora_modules_option(adapters):
    """``--lora-modules`` parsing, and ``build_engine`` loading them (refusing a bad one)."""
    from pagedllm.entrypoints.openai.api_server import build_engine

    paths, _, dora = adapters
    args = EngineArgs.from_kwargs(enable_lora=True, max_loras=2, num_gpu_blocks_override=16, max_model_len=64)
    engine = build_engine(args, tiny_chat_engine, [LoRARequest("a0", 1, str(paths[0]))])
    assert engine.list_loras() == {1}
    with pytest.raises(ValueError, match="DoRA"):
        build_engine(args, tiny_chat_engine, [LoRARequest("d", 1, str(dora))])
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        ("a", "/x"), ("b", "/y")]
    for bad, match in [(["a"], "name=path"), (["a=/x", "a=/y"], "given twice"), (["{"], "not valid JSON")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(bad)
    assert APIKey("k", "s").lora_adapters is None

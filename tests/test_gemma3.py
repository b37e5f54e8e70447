"""Gemma 3: sliding-window attention (C++ kernel and torch paths against a dense reference), a
tiny random Gemma 3 against Hugging Face ``Gemma3ForCausalLM``, the split package's SHA256
check, and the real Gemma 3 270M (greedy equal to transformers fp32 over a prompt longer than
its 512-token window; served by ``pagedllm serve``)."""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers.attention import (AttentionMetadata, PrefillSequence, paged_attention,
                                       paged_decode_attention, paged_decode_attention_torch)
from pagedllm.layers.ops import native_ops
from pagedllm.models import registry
from pagedllm.models.registry import NAMED_MODELS, NamedModel, resolve_named_model
from pagedllm.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.test_attention import BLOCK_SIZE, NUM_BLOCKS, dense_reference, random_caches, random_decode_batch

GEMMA = "gemma-3-270m"
needs_gemma = pytest.mark.skipif(not NAMED_MODELS[GEMMA].is_installed(),
                                 reason="pagedllm pull gemma-3-270m")




# head_dim 64 and 256 (Gemma 3) take the AVX-512 path where the CPU has it, 48 the generic one;
# windows of one token, shorter than a block, not block-aligned, and longer than any context.
@pytest.mark.parametrize("head_dim", [48, 64, 256])
@pytest.mark.parametrize("window", [1, 5, 37, 1000])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_sliding_window_decode_native_and_torch_match_reference(head_dim, window, cache_dtype):
    kernel = native_ops()
    assert kernel is not None, "the C++ kernel did not build"
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(
        9, 8, 2, cache_dtype, seed=window + head_dim, head_dim=head_dim)
    query = query.float()
    scale = head_dim ** -0.5
    expected = torch.cat([dense_reference(query[i:i + 1], key_cache, value_cache, block_tables[i].tolist(),
                                             int(context_lens[i]), [int(context_lens[i]) - 1], scale, window)
                          for i in range(query.shape[0])])
    native = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, window)
    reference = paged_decode_attention_torch(query, key_cache, value_cache, block_tables, context_lens, scale,
                                             window)
    torch.testing.assert_close(native.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)


def test_sliding_window_must_be_positive():
    batch = random_decode_batch(2, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_decode_attention(*batch, 1.0, sliding_window=0)


@pytest.mark.parametrize("num_cached,q_len,window", [(0, 37, 8), (0, 37, 37), (16, 16, 20), (23, 40, 16),
                                                    (150, 7, 30), (150, 7, 1), (40, 30, 500)])
def test_sliding_window_prefill_matches_reference(num_cached, q_len, window):
    """A chunk at positions [num_cached, num_cached + q_len) with a window, over a cached prefix."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    key_cache, value_cache, g = random_caches(num_kv_heads, torch.float32, seed=num_cached + q_len + window)
    context_len = num_cached + q_len
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, num_heads, head_dim, generator=g)
    key = torch.randn(q_len, num_kv_heads, head_dim, generator=g)
    value = torch.randn(q_len, num_kv_heads, head_dim, generator=g)
    positions = list(range(num_cached, context_len))
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
    metadata = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSequence(0, q_len, context_len, table)])
    out = paged_attention(query, key, value, key_cache, value_cache, metadata, 0.125, sliding_window=window)
    expected = dense_reference(query, key_cache, value_cache, table.tolist(), context_len, positions, 0.125,
                                  window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 256, 48])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int8)])
def test_sliding_window_prefill_rows_are_decode_rows_in_any_chunks(head_dim, dtypes):
    """A 90-token prompt under a window of 37, computed whole, in chunks of 16 and 25, and as a
    last chunk after 60 cached tokens (a prefix-cache hit): every row bitwise the same, and the
    rows whose context the window cuts bitwise the decode kernel's. A bf16 Gemma 3 270M gave a
    first-token logprob 0.06 apart between a prompt and the same prompt after a cache hit while
    SDPA computed these rows (a new user's report)."""
    assert native_ops() is not None, "the C++ kernel did not build"
    query_dtype, cache_dtype = dtypes
    num_heads, num_kv_heads, window, prompt_len = 8, 2, 37, 90
    g = torch.Generator().manual_seed(head_dim)
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-prompt_len // BLOCK_SIZE)]
    query = torch.randn(prompt_len, num_heads, head_dim, generator=g).to(query_dtype)
    key = torch.randn(prompt_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    value = torch.randn(prompt_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    scale = head_dim ** -0.5

    def run(chunks: list[int]) -> torch.Tensor:
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim + (4 if cache_dtype == torch.int8 else 0))
        key_cache = torch.zeros(shape, dtype=cache_dtype)
        value_cache = torch.zeros(shape, dtype=cache_dtype)
        outs, first = [], 0
        for size in chunks:
            rows = slice(first, first + size)
            slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                                  for p in range(first, first + size)])
            metadata = AttentionMetadata(slot_mapping=slots,
                                         prefills=[PrefillSequence(0, size, first + size, table, prompt_len)])
            outs.append(paged_attention(query[rows], key[rows], value[rows], key_cache, value_cache, metadata,
                                        scale, sliding_window=window))
            first += size
        decoded = paged_decode_attention(query[window:], key_cache, value_cache,
                                         table.repeat(prompt_len - window, 1), torch.arange(window + 1, prompt_len + 1),
                                         scale, window)
        return torch.cat(outs), decoded

    whole, decoded = run([prompt_len])
    assert torch.equal(whole[window:], decoded)
    # The rows before the window cuts attend without one: bitwise in any chunk where a C++
    # prefill kernel takes head_dim (64, 128, 256), else through SDPA (close, docs/sampling.md).
    first_same = 0 if torch.ops.pagedllm.prefill_attention_supported(head_dim) else window
    for chunks in ([16] * 5 + [10], [25, 25, 25, 15], [60, 30]):
        out, _ = run(chunks)
        assert torch.equal(out[first_same:], whole[first_same:]), chunks


# ------------------------------------------------------------------ tiny Gemma 3 against HF
WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A random 3-layer Gemma 3 (local, global, local; window 8; query_pre_attn_scalar unlike
    head_dim; random norm weights) saved by transformers and loaded back by pagedllm's loader."""
    from transformers import Gemma3ForCausalLM as HFGemma3
    from transformers import Gemma3TextConfig

    from pagedllm.models.loader import build_model, load_checkpoint

    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    hf = HFGemma3(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(0, 0.3 if "norm" in name else 0.2 if "embed" not in name else 0.1)
    folder = tmp_path_factory.mktemp("tiny_gemma3")
    hf.save_pretrained(str(folder))
    ours_config, state_dict = load_checkpoint(folder)
    assert ours_config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (ours_config.sliding_window, ours_config.query_pre_attn_scalar) == (WINDOW, 24.0)
    return hf, build_model(ours_config, state_dict, torch.float32)


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy, EOS ignored, over HF's forward and its cache; logits of the last row only."""
    out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    tokens = []
    for _ in range(max_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def greedy(model, prompts: list[list[int]], max_tokens: int, **engine_kwargs) -> list[list[int]]:
    kwargs = dict(dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineArgs.from_kwargs(**kwargs), model=model, tokenizer=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    return [finals[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))]


def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, WINDOW, 3 * WINDOW + 5)]


def test_tiny_gemma3_greedy_equals_transformers(tiny_gemma):
    hf, model = tiny_gemma
    prompts = tiny_prompts()
    expected = [hf_greedy(hf, p, 2 * WINDOW) for p in prompts]
    assert greedy(model, prompts, 2 * WINDOW) == expected
    # Chunks of 6 tokens: prefill chunks whose window reaches back into cached blocks.
    assert greedy(model, prompts, 2 * WINDOW, max_num_batched_tokens=6, max_num_seqs=1) == expected


def test_tiny_gemma3_native_equals_torch_attention(tiny_gemma, monkeypatch):
    _, model = tiny_gemma
    assert native_ops() is not None
    native = greedy(model, tiny_prompts(), 2 * WINDOW)
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    native_ops.cache_clear()
    try:
        assert native_ops() is None
        assert greedy(model, tiny_prompts(), 2 * WINDOW) == native
    finally:
        monkeypatch.delenv("PAGEDLLM_NATIVE_OPS")
        native_ops.cache_clear()


def test_tiny_gemma3_window_changes_the_output(tiny_gemma):
    """The window is not a no-op: the same weights with full attention everywhere answer
    differently once the prompt is longer than the window."""
    import dataclasses

    from pagedllm.models.loader import build_model

    hf, model = tiny_gemma
    config = dataclasses.replace(model.config, layer_types=("full_attention",) * 3)
    state_dict = {k: v.float() for k, v in hf.state_dict().items()}
    full = build_model(config, state_dict, torch.float32)
    windowed, unwindowed = greedy(model, tiny_prompts(), 2 * WINDOW), greedy(full, tiny_prompts(), 2 * WINDOW)
    assert windowed[2] != unwindowed[2]  # its prompt alone is longer than the window


# ----------------------------------------------------------------- split package + SHA256
def fake_split_model(tmp_path, monkeypatch, stated_digest: str | None) -> NamedModel:
    """Two one-file packages and a third stating the SHA256, importable from ``tmp_path``."""
    for i, data in ((1, b"GGUF first part "), (2, b"second part")):
        package = tmp_path / f"fake_gguf_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"m.gguf.part0{i}").write_bytes(data)
    meta = tmp_path / "fake_gguf"
    (meta / "data").mkdir(parents=True)
    (meta / "__init__.py").write_text("")
    digest = stated_digest or hashlib.sha256(b"GGUF first part second part").hexdigest()
    (meta / "data" / "SHA256SUMS").write_text(f"{digest}  m.gguf\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = NamedModel(name="fake", description="", requirements=(),
                       parts=tuple((f"fake_gguf_part{i}", f"data/m.gguf.part0{i}") for i in (1, 2)),
                       file_name="m.gguf", size_bytes=27, sha256_file=("fake_gguf", "data/SHA256SUMS"))
    monkeypatch.setitem(registry.NAMED_MODELS, "fake", model)
    return model


@needs_gemma
def test_gemma_registry_entry_reads_the_packaged_sha256():
    model = NAMED_MODELS[GEMMA]
    assert model.expected_sha256() == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert sum(p.stat().st_size for p in model.part_paths()) == model.size_bytes


def test_split_model_checked_against_the_stated_sha256(tmp_path, monkeypatch):
    fake_split_model(tmp_path / "packages", monkeypatch, stated_digest=None)
    path = resolve_named_model("fake", tmp_path / "cache")
    assert path.read_bytes() == b"GGUF first part second part"
    assert "fake_gguf" not in sys.modules  # located, never imported


def test_split_model_with_a_wrong_sha256_is_refused(tmp_path, monkeypatch):
    fake_split_model(tmp_path / "packages", monkeypatch, stated_digest="0" * 64)
    with pytest.raises(ValueError, match="assembled file has SHA256 .*, its package states 0000"):
        resolve_named_model("fake", tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


# ------------------------------------------------------------------------ the real model
# ~600 tokens: longer than the 512-token window of the local layers.
LONG_TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
             "father had taught him, and lit the great lamp that warned ships away from the rocks. ") * 16 + \
    "How many steps did he count? He counted"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def gemma_llm():
    from pagedllm import LLM

    return LLM(model=GEMMA, dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024)


@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_greedy_equals_transformers_fp32(gemma_llm):
    from transformers import AutoModelForCausalLM

    from pagedllm.models.loader import model_folder, resolve_model_path

    engine = gemma_llm.llm_engine
    assert type(engine.model).__name__ == "Gemma3ForCausalLM"
    assert engine.model.config.sliding_window == 512
    tokenizer = gemma_llm.get_tokenizer()
    assert tokenizer.chat_template is None  # the base model: the GGUF carries no template
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode(LONG_TEXT)]
    assert prompts[0][0] == tokenizer.bos_token_id and 550 <= len(prompts[1]) <= 700, len(prompts[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in gemma_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    chunked = LLMEngine(EngineArgs.from_kwargs(dtype="float32", max_model_len=1024, max_num_batched_tokens=256,
                                               kv_cache_memory_bytes=64 * 2**20),
                        model=engine.model, tokenizer=engine.tokenizer)
    chunked.add_request("long", {"prompt_token_ids": prompts[1]}, params)
    assert run_to_completion(chunked)["long"].outputs[0].token_ids == ours[1]

    hf = AutoModelForCausalLM.from_pretrained(str(model_folder(resolve_model_path(GEMMA))), dtype=torch.float32)
    assert type(hf).__name__ == "Gemma3ForCausalLM" and hf.config.sliding_window == 512
    assert [hf_greedy(hf.eval(), p, MAX_TOKENS) for p in prompts] == ours


@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_served(gemma_llm, tmp_path):
    """``pagedllm serve --model gemma-3-270m``: completions equal the offline greedy text; chat
    is refused with a 400 (no chat template in the base model's GGUF)."""
    import httpx

    from tests.test_server import ServerProcess

    prompt = "The capital of France is"
    expected = gemma_llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                  use_tqdm=False)[0].outputs[0].text
    server = ServerProcess("--model", GEMMA, "--dtype", "float32", "--max-model-len", "512",
                           "--kv-cache-memory-bytes", str(32 * 2**20), log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"model": GEMMA, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                          json={"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 400 and "no chat template" in chat.text
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()
    # Offline too, a ValueError of ours rather than transformers' own (a new user's report).
    with pytest.raises(ValueError, match="this model has no chat template"):
        gemma_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("key,value,message", [
    ("rope_scaling", {"rope_type": "linear", "factor": 8.0}, "rope_scaling"),
    ("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}, "rope_type"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("hidden_activation", "gelu", "hidden_activation")])
def test_unsupported_gemma_configs_are_refused(key, value, message):
    from pagedllm.models.gemma3 import Gemma3ForCausalLM

    raw = {"num_hidden_layers": 2, key: value}
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM.config_from_hf(raw, {})


def test_hub_style_gemma_config_is_read():
    """google/gemma-3-270m's config.json spells the RoPE bases as ``rope_theta`` and
    ``rope_local_base_freq`` (no ``rope_parameters``) and may omit ``layer_types``."""
    from tests.conftest import tiny_config
    from pagedllm.models.gemma3 import Gemma3ForCausalLM

    common = vars(tiny_config(num_hidden_layers=7, tie_word_embeddings=False))
    raw = {"num_hidden_layers": 7, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "sliding_window": 512, "query_pre_attn_scalar": 256}
    config = Gemma3ForCausalLM.config_from_hf(raw, common)
    assert (config.rope_theta, config.rope_local_base_freq) == (1_000_000.0, 10_000.0)
    assert (config.sliding_window, config.query_pre_attn_scalar, config.tie_word_embeddings) == (512, 256.0, True)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")


def test_tensor_parallel_is_refused_by_name(tiny_gemma):
    from pagedllm.models.gemma3 import Gemma3ForCausalLM
    from pagedllm.models.sharding import TensorParallelShard

    config = tiny_gemma[1].config
    with pytest.raises(ValueError, match="Gemma 3 runs with tensor_parallel_size=1 only, got 2"):
        Gemma3ForCausalLM(config, tp=TensorParallelShard(rank=0, size=2))
    # The engine asks before it spawns any rank (found by the fresh-user check: a rank was
    # spawned first and printed its own traceback).
    with pytest.raises(ValueError, match="'gemma3_text' family runs with tensor_parallel_size=1 only"):
        TensorParallelShard(rank=0, size=2).check(config)

"""``pagedllm plan``: trace parsing, the replay against the real engine, rejections, the sweep
and its recommendation on a hand-derived example, the cost-model fit, the CLI, and the
server's request log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import sys

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.request_log import RequestLog
from pagedllm.entrypoints import cli
from pagedllm.planner.cost_model import FEATURES, CostModel, ModelFacts, StepShape, fit_coefficients
from pagedllm.planner.replay import MAX_REPLAY_BLOCKS, PlanConfig, replay, summarize
from pagedllm.planner.sweep import (SweepSpace, build_configs, format_table, parse_size, recommend,
                                    run_sweep)
from pagedllm.planner.trace import load_trace
from pagedllm.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_engine

# One KV block of 4 tokens is 2 (K, V) x 1 layer x 4 tokens x 1 head x 2 dims x 4 bytes = 64 bytes.
FACTS = ModelFacts(model=None, dtype="float32", kv_cache_dtype="float32", num_layers=1, num_kv_heads=1,
                   head_dim=2, kv_element_bytes=4, vocab_size=TINY_VOCAB, max_position_embeddings=4096)


def one_second_per_step() -> CostModel:
    """Every step takes 1 s, so the simulated clock counts steps."""
    return CostModel({**dict.fromkeys(FEATURES, 0.0), "intercept": 1.0}, FACTS)


# ----------------------------------------------------------------------------- trace
def test_trace_forms_sorting_and_shared_prefixes():
    lines = [
        '{"arrival": 2.5, "prompt_tokens": 10, "output_tokens": 3, "prefix_id": "sys", "prefix_tokens": 6}',
        '',
        '{"arrival": 0, "prompt_token_ids": [1, 2, 3], "output_tokens": 1, "id": "ids"}',
        '{"arrival": 1, "prompt": "ab c", "output_tokens": 2}',
        '{"arrival": 2.5, "prompt_tokens": 8, "output_tokens": 4, "prefix_id": "sys", "prefix_tokens": 4}',
        '{"arrival": 3, "prompt_tokens": 10, "output_tokens": 3, "prefix_id": "other", "prefix_tokens": 6}',
    ]
    trace = load_trace(lines, TINY_VOCAB, encode=lambda text: [ord(c) for c in text])
    assert [r.request_id for r in trace] == ["ids", "line-4", "line-1", "line-5", "line-6"]
    assert [r.arrival_time for r in trace] == [0.0, 1.0, 2.5, 2.5, 3.0]
    assert trace[0].prompt_token_ids == (1, 2, 3)
    assert trace[1].prompt_token_ids == (97, 98, 32, 99) and trace[1].output_tokens == 2
    sys_long, sys_short, other = trace[2], trace[3], trace[4]
    assert (sys_long.num_prompt_tokens, sys_short.num_prompt_tokens, other.num_prompt_tokens) == (10, 8, 10)
    # Same prefix id: the shorter prefix is the start of the longer one; the rest is the line's own.
    assert sys_short.prompt_token_ids[:4] == sys_long.prompt_token_ids[:4]
    assert sys_short.prompt_token_ids[4:] != sys_long.prompt_token_ids[4:8]
    assert other.prompt_token_ids[:6] != sys_long.prompt_token_ids[:6]
    assert all(0 <= t < TINY_VOCAB for r in trace for t in r.prompt_token_ids)
    # Deterministic: the same file gives the same ids.
    assert load_trace(lines, TINY_VOCAB, encode=lambda text: [ord(c) for c in text]) == trace


@pytest.mark.parametrize("line, message", [
    ('{"arrival": 0, "prompt_tokens": 4', "line 2: not valid JSON"),
    ('[1, 2]', "line 2: a request must be a JSON object"),
    ('{"arrival": -1, "prompt_tokens": 4, "output_tokens": 1}', "line 2: arrival must be a number of seconds in [0, "),
    # a fresh user's 1e300 s printed a 300-digit span; 1e9 s is past the ten-year limit
    ('{"arrival": 1e9, "prompt_tokens": 4, "output_tokens": 1}',
     "line 2: arrival must be a number of seconds in [0, 315360000] (ten years), got 1000000000.0"),
    ('{"arrival": 0, "prompt_tokens": 4}', "line 2: output_tokens must be an integer >= 1, got None"),
    ('{"arrival": 0, "prompt_tokens": 0, "output_tokens": 1}', "line 2: prompt_tokens must be an integer >= 1, got 0"),
    # a fresh user's report: 10**10 spun for minutes building the prompt's ids
    ('{"arrival": 0, "prompt_tokens": 10000000000, "output_tokens": 1}',
     "line 2: prompt_tokens must be <= 16777216 (longer than any model's context), got 10000000000"),
    ('{"arrival": 0, "prompt_tokens": 4, "prompt": "x", "output_tokens": 1}', "line 2: give exactly one of"),
    ('{"arrival": 0, "output_tokens": 1}', "line 2: give exactly one of"),
    ('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 1, "prefix_id": "a", "prefix_tokens": 5}',
     "line 2: prefix_tokens (5) is larger than prompt_tokens (4)"),
    ('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 1, "prefix_id": "a"}',
     "line 2: prefix_id and prefix_tokens go together"),
    ('{"arrival": 0, "prompt_token_ids": [1, 999], "output_tokens": 1}',
     "line 2: prompt token id 999 is outside the vocabulary [0, 256)"),
    ('{"arrival": 0, "prompt": "hi", "output_tokens": 1}', "line 2: a text prompt needs the model's tokenizer"),
    ('{"arrival": 0, "prompt": 100, "output_tokens": 1}',
     "line 2: prompt must be a non-empty string (a count is prompt_tokens, token ids are prompt_token_ids), got 100"),
    ('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 1, "max_tokens": 3}', "line 2: unknown field(s) 'max_tokens'"),
    ('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 1, "id": "a"}', "line 2: id 'a' is already used on line 1"),
])
def test_a_bad_line_is_a_value_error_naming_its_line(line, message):
    good = '{"arrival": 0, "prompt_tokens": 4, "output_tokens": 1, "id": "a"}'
    with pytest.raises(ValueError, match="trace " + re.escape(message)):
        load_trace([good, line], TINY_VOCAB)


def test_an_empty_trace_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no request"):
        load_trace(["", "  "], TINY_VOCAB)
    with pytest.raises(ValueError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl", TINY_VOCAB)


# ----------------------------------------------------------------------------- replay vs engine
def random_trace(seed: int, num_requests: int = 40) -> list[str]:
    rng = random.Random(seed)
    lines, arrival = [], 0.0
    for index in range(num_requests):
        arrival += rng.choice([0, 0, 1, 2, 3])
        request = {"arrival": arrival, "prompt_tokens": rng.randint(3, 40), "output_tokens": rng.randint(1, 30)}
        if index % 3 == 0:
            request.update(prefix_id=f"p{index % 2}", prefix_tokens=min(request["prompt_tokens"], 12))
        lines.append(json.dumps(request))
    lines.append(json.dumps({"arrival": arrival, "prompt_tokens": 60, "output_tokens": 10}))  # > max_model_len
    return lines


def run_engine_on_trace(trace, enable_prefix_caching: bool, **config) -> tuple[list[tuple[int, int]], int, int]:
    """The real engine (tiny model) stepped over ``trace`` with 1 s per scheduled step, as the
    replay's clock runs; returns (running, blocks in use) after each schedule, preemptions and
    rejected requests."""
    engine = make_tiny_engine(enable_prefix_caching=enable_prefix_caching, **config)
    scheduler, pool = engine.scheduler, engine.kv_cache_manager.block_pool
    schedule, seen = scheduler.schedule, []

    def recording_schedule():
        output = schedule()
        seen.append(None if output.is_empty else (scheduler.num_running, pool.num_used_blocks))
        return output

    scheduler.schedule = recording_schedule
    clock, index, rejected = trace[0].arrival_time, 0, 0
    while index < len(trace) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock = max(clock, trace[index].arrival_time)
        while index < len(trace) and trace[index].arrival_time <= clock:
            request = trace[index]
            try:
                engine.add_request(request.request_id, list(request.prompt_token_ids),
                                   SamplingParams(max_tokens=request.output_tokens, ignore_eos=True, temperature=0.0))
            except ValueError:
                rejected += 1
            index += 1
        if engine.has_unfinished_requests():
            engine.step()
            clock += seen[-1] is not None
    pool.check_invariants()
    return [s for s in seen if s is not None], engine.scheduler.num_preemptions, rejected


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_replay_matches_the_real_engine_step_by_step(enable_prefix_caching):
    config = dict(num_gpu_blocks_override=24, block_size=4, max_model_len=64, max_num_seqs=6,
                  max_num_batched_tokens=32)
    trace = load_trace(random_trace(1), TINY_VOCAB)
    result = replay(trace, PlanConfig(max_model_len=64, num_blocks=24, block_size=4, max_num_seqs=6,
                                      max_num_batched_tokens=32, enable_prefix_caching=enable_prefix_caching),
                    one_second_per_step())
    engine_steps, engine_preemptions, engine_rejected = run_engine_on_trace(trace, enable_prefix_caching, **config)
    metrics = summarize(result)
    assert [(s.num_running, s.num_used_blocks) for s in result.steps] == engine_steps
    assert metrics.peak_blocks == max(blocks for _, blocks in engine_steps) == 24
    assert metrics.peak_concurrency == max(running for running, _ in engine_steps)
    assert metrics.num_preemptions == engine_preemptions > 0
    assert metrics.num_rejected == engine_rejected == 4  # prompt + output above max_model_len
    if enable_prefix_caching:
        assert metrics.prefix_cache_hit_tokens > 0


def test_requests_that_never_fit_are_rejected_with_the_engine_message():
    lines = ['{"arrival": 0, "prompt_tokens": 8, "output_tokens": 4, "id": "fits"}',
             '{"arrival": 0, "prompt_tokens": 30, "output_tokens": 10, "id": "too-long"}',
             '{"arrival": 1, "prompt_tokens": 32, "output_tokens": 1, "id": "prompt-fills-all"}']
    result = replay(load_trace(lines, TINY_VOCAB), PlanConfig(max_model_len=32, num_blocks=8, block_size=4),
                    one_second_per_step())
    assert [r.request_id for r in result.requests] == ["fits"]
    capacity = "(the KV cache holds 32 tokens: 8 blocks of 4)"
    assert {request.request_id: reason for request, reason in result.rejected} == {
        "too-long": f"prompt (30 tokens) + max_tokens (10) = 40 tokens exceeds max_model_len=32 {capacity}",
        "prompt-fills-all": f"the prompt has 32 tokens, but max_model_len is 32 {capacity} and at least one token "
                            "must be generated: the prompt may have at most 31 tokens"}
    metrics = summarize(result)
    assert (metrics.num_requests, metrics.num_rejected, metrics.span) == (3, 2, 4.0)


def test_a_configuration_the_engine_refuses_is_refused():
    with pytest.raises(ValueError, match="fewer than one request of max_model_len=64"):
        replay([], PlanConfig(max_model_len=64, num_blocks=8, block_size=4), one_second_per_step())
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        PlanConfig(max_model_len=8, num_blocks=8, block_size=4, max_num_seqs=16, max_num_batched_tokens=8).check()
    # a fresh user's report: --memory 99999999TiB spun building a pool of 10**15 blocks
    with pytest.raises(ValueError, match=f"gives {MAX_REPLAY_BLOCKS + 1} blocks of 4 tokens; a replay holds at most "
                                         f"{MAX_REPLAY_BLOCKS} blocks"):
        PlanConfig(max_model_len=8, num_blocks=MAX_REPLAY_BLOCKS + 1, block_size=4).check()


# ----------------------------------------------------------------------------- sweep
TWO_REQUESTS = ['{"arrival": 0, "prompt_tokens": 8, "output_tokens": 4}',
                '{"arrival": 0, "prompt_tokens": 8, "output_tokens": 4}']


def test_sweep_and_recommendation_on_a_hand_derived_example():
    """Two requests of 8 prompt + 4 output tokens, blocks of 4, 1 s per step.

    Each needs 2 blocks after its prefill and 3 from its first decode on, so 6 blocks run both
    without preemption: prefill at t=0-1 (first tokens), decodes until t=4; 8 tokens in 4 s.
    With 5 blocks the second is preempted at its first decode (step 2), cannot come back while
    the first holds 3 of the 5 blocks, is recomputed at step 5 and ends at t=7.
    With 100 blocks nothing changes but the memory. The planner must pick 6 blocks (384 B).
    """
    trace = load_trace(TWO_REQUESTS, TINY_VOCAB)
    space = SweepSpace(kv_cache_bytes=[parse_size("320B"), parse_size("384B"), parse_size("6400B")],
                       max_model_lens=[16], max_num_seqs=[8], max_num_batched_tokens=[64], block_sizes=[4],
                       prefix_caching=[True, False])
    built = build_configs(space, one_second_per_step())
    assert all(why == "" for _, why in built)
    rows = run_sweep(trace, [config for config, _ in built], one_second_per_step())
    by_blocks = {(row.config.num_blocks, row.config.enable_prefix_caching): row.metrics for row in rows}
    assert sorted(by_blocks) == [(5, False), (5, True), (6, False), (6, True), (100, False), (100, True)]
    for caching in (True, False):
        enough, short = by_blocks[6, caching], by_blocks[5, caching]
        assert (enough.peak_blocks, enough.num_preemptions, enough.span, enough.throughput) == (6, 0, 4.0, 2.0)
        assert (enough.peak_concurrency, enough.mean_concurrency, enough.ttft_p95, enough.tpot_p50) == (2, 2.0, 1.0, 1.0)
        # Measured after each schedule: in step 2 the first request takes the fifth block and the
        # second gives back its 2 within the same schedule (3 in use after it): the peak is step 1's 4.
        assert (short.peak_blocks, short.num_preemptions, short.span) == (4, 1, 7.0)
        assert short.mean_concurrency == pytest.approx(8 / 7)  # 2 for the first step, then 1
        assert by_blocks[100, caching].span == 4.0
    for row in rows:
        expected = [1.0, 2.0] if row.config.num_blocks == 5 else [1.0, 1.0]  # the second: (7 - 1) / 3
        assert sorted(r.tpot for r in row.result.requests) == expected
    chosen, paragraph = recommend(rows)
    assert (rows[chosen].config.num_blocks, rows[chosen].config.enable_prefix_caching) == (6, True)
    assert paragraph.startswith("Recommended: max_model_len=16, KV cache 384 B (6 blocks of 4 tokens), max_num_seqs=8, "
                                "max_num_batched_tokens=64, prefix caching on. With it all 2 requests are served")
    assert "smaller budgets (320 B) lose more than 5 % of throughput or p95 TTFT" in paragraph
    table = format_table(rows, chosen).splitlines()
    assert len(table) == 2 + len(rows) and table[2 + chosen].lstrip().startswith(f"{chosen + 1}*")


def test_recommendation_prefers_serving_more_requests():
    rows = run_sweep(load_trace(TWO_REQUESTS + ['{"arrival": 0, "prompt_tokens": 30, "output_tokens": 4}'],
                                TINY_VOCAB),
                     [PlanConfig(max_model_len=16, num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                 kv_cache_bytes=384),
                      PlanConfig(max_model_len=40, num_blocks=20, block_size=4, max_num_seqs=8,
                                 max_num_batched_tokens=64, kv_cache_bytes=1280)], one_second_per_step())
    assert [row.metrics.num_rejected for row in rows] == [1, 0]
    chosen, paragraph = recommend(rows)
    assert chosen == 1 and "all 3 requests are served" in paragraph


@pytest.mark.parametrize("text, expected", [("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                            ("4096", 4096), ("2kib", 2048)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "8XB", "-1GiB", "0", "GiB"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


# ----------------------------------------------------------------------------- cost model
def test_fit_recovers_known_coefficients_despite_slow_outliers():
    truth = {"intercept": 0.01, "has_prefill": 0.005, "prefill_tokens": 2e-4, "prefill_seqs": 1e-3,
             "prefill_attention": 3e-5, "decode_seqs": 5e-4, "decode_context": 2e-6}
    model = CostModel(truth, FACTS)
    rng = random.Random(0)
    shapes = []
    for _ in range(120):
        prefill_seqs = rng.choice([0, 0, 1, 2])
        tokens = sum(rng.randint(2, 512) for _ in range(prefill_seqs))
        decodes = rng.randint(0 if prefill_seqs else 1, 40)
        shapes.append(StepShape(tokens, prefill_seqs, tokens * rng.randint(1, 3) * tokens / 1000 / max(1, prefill_seqs),
                                decodes, decodes * rng.randint(16, 2048)))
    times = [model.step_time(shape) for shape in shapes]
    for index in range(0, 120, 15):  # a neighbour stole the CPU on every 15th step
        times[index] *= 10
    fitted = fit_coefficients(shapes, times)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=1e-2), name


def test_cost_model_file_round_trip_and_errors(tmp_path):
    model = CostModel({**dict.fromkeys(FEATURES, 0.0), "intercept": 0.02, "decode_seqs": 1e-3}, FACTS,
                      {"cpu": "test"})
    path = tmp_path / "cost.json"
    model.save(path)
    loaded = CostModel.load(path)
    assert loaded.coefficients == model.coefficients and loaded.facts == FACTS
    assert loaded.step_time(StepShape(decode_seqs=10)) == pytest.approx(0.03)
    assert FACTS.bytes_per_block(16) == 2 * 1 * 16 * 1 * 2 * 4
    # An int8 cache: 2 one-byte codes and a 4-byte scale per token and KV head.
    int8 = dataclasses.replace(FACTS, kv_cache_dtype="int8", kv_element_bytes=1)
    assert int8.bytes_per_block(16) == 2 * 1 * 16 * 1 * (2 + 4)
    document = json.loads(path.read_text())
    document["coefficients"]["decode_seqs"] = -1
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="coefficient 'decode_seqs' must be a number >= 0"):
        CostModel.load(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match='"version": 1'):
        CostModel.load(path)


# ----------------------------------------------------------------------------- CLI
def test_cli_plan_end_to_end(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TWO_REQUESTS) + "\n")
    cost = tmp_path / "cost.json"
    one_second_per_step().save(cost)
    plots = tmp_path / "plots"
    code = cli.main(["plan", "--trace", str(trace), "--cost-model", str(cost), "--memory", "320B,384B,6400B",
                     "--max-model-len", "16", "--block-size", "4", "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "64", "--plot-dir", str(plots)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "trace: 2 requests over 0.0 s, 16 prompt tokens, 8 output tokens, longest 12 tokens" in out
    assert "Recommended: max_model_len=16, KV cache 384 B (6 blocks of 4 tokens)" in out
    assert sum(line.lstrip()[:1].isdigit() for line in out.splitlines()) == 6  # one table row per configuration
    pytest.importorskip("matplotlib")
    for name in ("concurrency.png", "kv_usage.png", "latency_cdf.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_series_fall_to_zero_across_idle_gaps():
    """A fresh user's plot showed 1 request running through a 60 s gap between two requests,
    where the table (PlanMetrics) counts idle time as zero: the series drop to 0 at the end of
    a step that a gap (or the end) follows, and steps back to back stay joined."""
    from pagedllm.planner.replay import StepRecord
    from pagedllm.planner.sweep import step_series

    def step(start, duration, running):
        return StepRecord(start, duration, running, 0, 1, running, 0, 0, 0, 0)

    steps = [step(0.0, 0.5, 1), step(0.5, 0.5, 2), step(60.0, 1.0, 1)]
    assert step_series(steps, lambda s: s.num_running) == ([0.0, 0.5, 1.0, 60.0, 61.0], [1, 2, 0, 1, 0])


def test_cli_plan_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TWO_REQUESTS) + "\n")
    cost = tmp_path / "cost.json"
    one_second_per_step().save(cost)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["plan", "--trace", str(trace), "--cost-model", str(cost), "--memory", "6400B",
                     "--max-model-len", "16", "--block-size", "4", "--plot-dir", str(tmp_path / "p")]) == 0
    assert "plots skipped: matplotlib is not installed (pip install 'pagedllm[plot]')" in capsys.readouterr().out


def test_cli_plan_reports_a_bad_trace_line(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TWO_REQUESTS[0] + '\n{"arrival": 0, "prompt_tokens": 4, "output_tokens": 0}\n')
    cost = tmp_path / "cost.json"
    one_second_per_step().save(cost)
    assert cli.main(["plan", "--trace", str(trace), "--cost-model", str(cost), "--memory", "1KiB"]) == 2
    assert f"error: {trace} line 2: output_tokens must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_bad_trace_is_reported_before_calibrating(tmp_path, capsys, monkeypatch):
    """Without a cost model the planner calibrates (tens of seconds); a malformed trace is
    refused first."""
    from pagedllm.planner import plan as plan_module

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival": 0, "prompt_tokens": 4, "output_tokens": 0}\n')
    monkeypatch.setattr(plan_module, "calibrate_model", lambda *args: pytest.fail("calibrated a bad trace"))
    assert cli.main(["plan", "--trace", str(trace), "--cost-model", str(tmp_path / "absent.json")]) == 2
    assert f"error: {trace} line 1: output_tokens must be an integer >= 1, got 0" in capsys.readouterr().err


def test_without_memory_the_sweep_runs_from_the_smallest_budget_to_the_default(tmp_path, capsys):
    """No ``--memory``: six budgets from the smallest that holds the longest request (12 tokens
    = 3 blocks of 4 tokens of 64 bytes: 192 B) to the cost model's default (192 KiB), spaced
    geometrically (x4); the recommendation is then far below the default: the smallest budget
    that runs both requests at once (12 blocks; 3 would run them one after the other)."""
    from pagedllm.planner.plan import default_budgets

    trace = load_trace(TWO_REQUESTS, TINY_VOCAB)
    model = one_second_per_step()
    assert model.facts.bytes_per_block(4) == 64
    assert default_budgets(192 * 1024, trace, model, [8, 4]) == [192, 768, 3072, 12288, 49152, 196608]
    assert default_budgets(150, trace, model, [4]) == [150]
    cost = tmp_path / "cost.json"
    CostModel(model.coefficients, dataclasses.replace(FACTS, default_kv_cache_bytes=192 * 1024)).save(cost)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(TWO_REQUESTS) + "\n")
    assert cli.main(["plan", "--trace", str(path), "--cost-model", str(cost), "--max-model-len", "16",
                     "--block-size", "4", "--prefix-caching", "on"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: max_model_len=16, KV cache 768 B (12 blocks of 4 tokens)" in out, out


def test_cli_plan_calibrates_a_dummy_model_from_its_config(tmp_path, capsys):
    """``plan --load-format dummy`` calibrates on random weights of a config.json (a model
    whose weights are not here); a trace of text prompts then has no tokenizer, said so; and
    without the option a config.json is refused as what it is, not as a broken GGUF."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "bench" / "configs" / "tiny-llama.json")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TWO_REQUESTS) + "\n")
    cost = tmp_path / "cost.json"
    common = ["plan", "--trace", str(trace), "--cost-model", str(cost), "--model", config, "--memory", "64KiB"]
    assert cli.main([*common, "--load-format", "dummy"]) == 0, capsys.readouterr()
    facts = CostModel.load(cost).facts
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim, facts.vocab_size) == (2, 1, 64, 256)
    assert "Recommended:" in capsys.readouterr().out
    trace.write_text('{"arrival": 0, "prompt": "hello", "output_tokens": 4}\n')
    assert cli.main([*common, "--load-format", "dummy"]) == 2
    assert "has no tokenizer: give the trace's prompts as token ids" in capsys.readouterr().err
    cost.unlink()
    assert cli.main(common) == 2
    assert "is not a GGUF file (a config.json alone has no weights" in capsys.readouterr().err


# ----------------------------------------------------------------------------- request log
def test_server_request_log_is_a_trace_that_replays(tmp_path):
    """The async engine logs finished requests; the log loads as a trace, and a request that
    hit the prefix cache carries the prefix it shared."""
    path = tmp_path / "requests.jsonl"
    engine = AsyncLLMEngine(make_tiny_engine(), request_log=RequestLog(path))
    engine.start()
    shared = list(range(1, 17))  # four full blocks of 4

    async def run() -> None:
        for prompt, max_tokens in ((shared + [20, 21], 5), (shared + [30], 3), ([7, 8, 9], 2)):
            stream = await engine.add_request(f"r{max_tokens}", prompt,
                                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
            async for _ in stream:
                pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in records] == [(18, 5), (17, 3), (3, 2)]
    assert "prefix_id" not in records[0] and "prefix_id" not in records[2]
    assert records[1]["prefix_tokens"] == 16 and len(records[1]["prefix_id"]) == 16
    assert 0 <= records[0]["arrival"] <= records[1]["arrival"] <= records[2]["arrival"]
    trace = load_trace(lines, TINY_VOCAB)
    assert [r.num_tokens for r in trace] == [23, 20, 5]


def test_serve_request_log_flag_writes_the_trace(tmp_path):
    """``pagedllm serve --request-log``: one line per finished request, replayable."""
    import httpx

    from tests.test_server import ServerProcess

    log = tmp_path / "requests.jsonl"
    server = ServerProcess("--served-model-name", "x", "--dtype", "float32",
                           "--max-model-len", "256", "--kv-cache-memory-bytes", str(4 * 2**20),
                           "--request-log", str(log), log_path=tmp_path / "server.log",
                           engine_factory="tests.test_server:tiny_chat_engine")
    try:
        server.wait_ready()
        for prompt, max_tokens in (([11, 12, 13, 14, 15], 6), ([21, 22], 3)):
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "x", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            assert response.status_code == 200, response.text
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in records] == [(5, 6), (2, 3)]
    assert records[0]["arrival"] <= records[1]["arrival"]
    assert [r.num_tokens for r in load_trace(log, 49152)] == [11, 5]


def test_calibrate_times_the_engine_steps_and_fits_every_sample(tmp_path):
    from pagedllm.planner.cost_model import calibrate
    engine = make_tiny_engine(num_gpu_blocks_override=4096, max_model_len=2048, max_num_seqs=32,
                              max_num_batched_tokens=2048, enable_prefix_caching=False)
    model = calibrate(engine, default_kv_cache_bytes=12345, log=lambda line: None)
    samples = model.calibration["samples"]
    assert model.calibration["steps"] == len(samples) > 50
    assert model.calibration["sample_fields"] == ["prefill_tokens", "prefill_seqs", "prefill_attention", "decode_seqs",
                                                  "decode_context", "seconds"]
    # The lone prefills come first: one step of n prompt tokens, then one decode of context n + 1.
    assert [tuple(s[:2]) for s in samples[:4:2]] == [(32, 1), (128, 1)]
    assert samples[1][3:5] == [1, 33]
    assert all(value >= 0 for value in model.coefficients.values()) and model.step_time(StepShape(decode_seqs=1)) > 0
    assert (model.facts.num_layers, model.facts.num_kv_heads, model.facts.head_dim, model.facts.vocab_size,
            model.facts.kv_element_bytes, model.facts.default_kv_cache_bytes) == (2, 2, 16, TINY_VOCAB, 4, 12345)
    assert not engine.has_unfinished_requests() and "schedule" not in vars(engine.scheduler)
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json").coefficients == model.coefficients

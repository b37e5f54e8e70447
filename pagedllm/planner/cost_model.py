"""Step time of the engine as a function of what a step schedules, fitted to a short measured
profile of the real model on this machine (``calibrate``) and saved as JSON.

The form is linear in six features of a step (``StepShape``):

    time = intercept
         + has_prefill      * [the step has a prefill chunk]     (decode-only steps run fused)
         + prefill_tokens   * tokens of prefill chunks            (matmuls over the chunk)
         + prefill_seqs     * prefill chunks                      (one attention call each)
         + prefill_attention* sum over chunks of n * (c + n) / 1000 (attention over the chunk's
                                                                  context, n new, c cached)
         + decode_seqs      * single-token sequences              (matmul rows, sampling)
         + decode_context   * sum of their context lengths        (paged attention reads)

which is the per-step roofline a CPU engine follows (weights read once per step, then work
per token and per attended position). Coefficients are seconds per unit, fitted by
non-negative least squares on relative error, so short decode steps weigh as much as long
prefills. As in vLLM's and Vidur's simulators, a sequence of steps is the unit of time: the
planner sums the predicted step times.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from pagedllm.config import kv_cache_bytes_per_block
from pagedllm.platform import cpu_model_name

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

FEATURES = ("intercept", "has_prefill", "prefill_tokens", "prefill_seqs", "prefill_attention",
            "decode_seqs", "decode_context")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StepShape:
    """What one step computes, before it runs (counts of tokens and sequences)."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention: float = 0.0  # sum over prefill chunks of n * (c + n) / 1000
    decode_seqs: int = 0
    decode_context: int = 0  # sum of the decoding sequences' context lengths (tokens)

    def features(self) -> list[float]:
        return [1.0, 1.0 if self.prefill_seqs else 0.0, self.prefill_tokens, self.prefill_seqs,
                self.prefill_attention, self.decode_seqs, self.decode_context]


def step_shape(scheduled: Sequence[tuple["Request", int]]) -> StepShape:
    """The shape of a ``SchedulerOutput.scheduled`` list, read before ``update_from_output``.

    A chunk of one token is a decode, as the model runner batches it (``n == 1``).
    """
    prefill_tokens = prefill_seqs = decode_seqs = decode_context = 0
    prefill_attention = 0
    for request, num_new in scheduled:
        if num_new == 1:
            decode_seqs += 1
            decode_context += request.num_computed_tokens + 1
        else:
            prefill_seqs += 1
            prefill_tokens += num_new
            prefill_attention += num_new * (request.num_computed_tokens + num_new)
    return StepShape(prefill_tokens, prefill_seqs, prefill_attention / 1000.0, decode_seqs, decode_context)


@dataclass
class ModelFacts:
    """What the planner needs of the model without loading it.

    Attributes:
        model: the model option it was measured with (None: the default model).
        dtype, kv_cache_dtype: compute and KV dtypes, as names.
        num_layers, num_kv_heads, head_dim, kv_element_bytes: KV geometry.
        vocab_size: synthetic prompt ids are drawn below it.
        max_position_embeddings: the model's context length.
        default_kv_cache_bytes: the KV budget ``LLMEngine`` would take by default on the
            calibrating machine (``memory_utilization`` 0.9), or None.
    """

    model: Optional[str]
    dtype: str
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_element_bytes: int
    vocab_size: int
    max_position_embeddings: int
    default_kv_cache_bytes: Optional[int] = None

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block (K and V, every layer); ``config.kv_cache_bytes_per_block``."""
        import torch
        dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}[self.kv_element_bytes]
        return kv_cache_bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype)


@dataclass
class CostModel:
    """Predicted seconds per step (see the module docstring for the form).

    Attributes:
        coefficients: seconds per unit of each feature, by name (``FEATURES``).
        facts: the model's KV geometry and defaults.
        calibration: how it was measured (CPU, threads, samples, fit error); informative.
    """

    coefficients: dict[str, float]
    facts: ModelFacts
    calibration: dict = field(default_factory=dict)

    def step_time(self, shape: StepShape) -> float:
        """Seconds the engine takes for a step of this shape."""
        return float(sum(self.coefficients[name] * value for name, value in zip(FEATURES, shape.features())))

    def save(self, path: Union[str, Path]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"version": FORMAT_VERSION, "coefficients": self.coefficients, "facts": asdict(self.facts),
                    "calibration": self.calibration}
        path.write_text(json.dumps(document, indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostModel":
        """Read a file written by ``save`` (or by hand in the same form).

        Raises:
            ValueError: unreadable, not JSON, another version, a missing or negative
                coefficient, or missing model facts.
        """
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read cost model {path}: {exc}") from None
        if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost model {path}: expected a JSON object with \"version\": {FORMAT_VERSION}")
        coefficients = document.get("coefficients")
        if not isinstance(coefficients, dict):
            raise ValueError(f"cost model {path}: \"coefficients\" must be an object")
        for name in FEATURES:
            value = coefficients.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"cost model {path}: coefficient {name!r} must be a number >= 0 (seconds), "
                                 f"got {value!r}")
        unknown = sorted(set(coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"cost model {path}: unknown coefficient(s) {unknown} (known: {list(FEATURES)})")
        if not any(coefficients.get(name, 0.0) > 0 for name in FEATURES):
            raise ValueError(f"cost model {path}: every coefficient is 0: steps would take no time")
        try:
            facts = ModelFacts(**document["facts"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost model {path}: bad \"facts\": {exc}") from None
        if facts.kv_element_bytes not in (1, 2, 4):
            raise ValueError(f"cost model {path}: kv_element_bytes must be 1 (int8), 2 (bfloat16) or 4 "
                             f"(float32), got {facts.kv_element_bytes!r}")
        return cls({name: float(coefficients.get(name, 0.0)) for name in FEATURES}, facts,
                   document.get("calibration", {}))


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: a column whose coefficient comes out negative is
    dropped (fixed at 0) and the rest refitted, until none is (the active-set idea of Lawson
    and Hanson's NNLS, one variable at a time)."""
    active = [index for index in range(x.shape[1]) if x[:, index].any()]
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        worst = int(np.argmin(solution))
        if solution[worst] >= 0 or len(active) == 1:
            break
        del active[worst]
    result = np.zeros(x.shape[1])
    result[active] = np.maximum(solution, 0.0)
    return result


def fit_coefficients(shapes: Sequence[StepShape], times: Sequence[float], iterations: int = 30) -> dict[str, float]:
    """Coefficients >= 0 minimizing the sum of absolute relative errors ``|predicted / measured - 1|``,
    by iteratively reweighted least squares (weights ``1 / max(|error|, 0.1 %)``).

    An absolute-error fit lets a few slow outliers drag every step up: on a shared machine a
    step that another process preempted can take ten times its usual time. The L1 fit
    predicts the typical step instead, so the planner models the engine, not its neighbours.

    Raises:
        ValueError: fewer samples than features, or a non-positive time.
    """
    if len(shapes) < len(FEATURES) or len(shapes) != len(times):
        raise ValueError(f"need at least {len(FEATURES)} (shape, time) samples, got {len(shapes)}")
    y = np.asarray(times, dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("step times must be > 0 seconds")
    x = np.asarray([s.features() for s in shapes], dtype=np.float64) / y[:, None]
    weights = np.ones_like(y)
    for _ in range(iterations):
        root = np.sqrt(weights)
        solution = _nonnegative_lstsq(x * root[:, None], root)
        weights = 1.0 / np.maximum(np.abs(x @ solution - 1.0), 1e-3)
    return {name: float(value) for name, value in zip(FEATURES, solution)}


def calibration_workload(vocab_size: int, max_num_seqs: int, max_len: int,
                         seed: int = 0) -> list[list[tuple[list[int], int]]]:
    """Phases of ``(prompt token ids, max_tokens)`` requests, each phase run to completion:
    lone prefills of 32 to 1024 tokens, decode batches of 1 to 32 sequences at short and long
    contexts, and a staggered phase whose steps mix decodes with prefill chunks."""
    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(min(length, max_len - 16))]

    phases = [[(prompt(length), 2)] for length in (32, 128, 512, 1024)]
    for batch in (1, 8, 32):
        for context in (32, 256):
            phases.append([(prompt(context), 12) for _ in range(min(batch, max_num_seqs))])
    phases.append([(prompt(rng.randint(32, 384)), 8) for _ in range(min(16, max_num_seqs))])
    return phases


def calibrate(engine: "LLMEngine", default_kv_cache_bytes: Optional[int] = None,
              log=logger.info) -> CostModel:
    """Measure step times of ``engine`` over ``calibration_workload`` (run twice, the second
    pass measured) and fit a ``CostModel``.

    The engine should have prefix caching off (every prompt token is computed) and nothing
    else running. Its ``step()`` is timed whole (scheduling, forward, sampling, outputs), and
    its scheduler's ``schedule`` is wrapped for the run to read each step's shape.

    Raises:
        ValueError: the fit fails (too few steps).
    """
    from pagedllm.sampling_params import SamplingParams

    scheduler = engine.scheduler
    schedule = scheduler.schedule
    shapes: list[StepShape] = []

    def recording_schedule():
        output = schedule()
        shapes.append(step_shape(output.scheduled))
        return output

    model_config = engine.model_config
    phases = calibration_workload(model_config.vocab_size, engine.args.max_num_seqs, engine.max_model_len)
    times: list[float] = []
    recorded: list[StepShape] = []
    scheduler.schedule = recording_schedule
    start = time.perf_counter()
    try:
        # The first pass only warms up: oneDNN builds a primitive per new row count and the KV
        # pool's pages fault in on first touch, which a server in steady state has behind it
        # (measured: the first pass ran 10-15 % slower than the second).
        for phase_index, phase in enumerate(phases + phases):
            recording = phase_index >= len(phases)
            staggered = phase_index % len(phases) == len(phases) - 1
            pending = list(phase)
            serial = 0
            while pending or engine.has_unfinished_requests():
                for _ in range(2 if staggered else len(pending)):
                    if pending:
                        prompt, max_tokens = pending.pop(0)
                        engine.add_request(f"calibrate-{phase_index}-{serial}", prompt,
                                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
                        serial += 1
                shapes.clear()
                step_start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - step_start
                if recording and shapes and (shapes[0].prefill_seqs or shapes[0].decode_seqs):
                    recorded.append(shapes[0])
                    times.append(elapsed)
    finally:
        del scheduler.schedule  # back to the class's method
    coefficients = fit_coefficients(recorded, times)
    model = CostModel(coefficients, ModelFacts(
        model=engine.args.model, dtype=str(engine.model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
        num_layers=model_config.num_hidden_layers, num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim, kv_element_bytes=engine.kv_cache_dtype.itemsize,
        vocab_size=model_config.vocab_size, max_position_embeddings=model_config.max_position_embeddings,
        default_kv_cache_bytes=default_kv_cache_bytes))
    predicted = np.asarray([model.step_time(s) for s in recorded])
    measured = np.asarray(times)
    relative = np.abs(predicted - measured) / measured
    import torch
    model.calibration = {
        "cpu": cpu_model_name(), "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "steps": len(times),
        "seconds": round(time.perf_counter() - start, 1),
        "median_relative_error": round(float(np.median(relative)), 4),
        "total_time_error": round(float(predicted.sum() / measured.sum() - 1), 4),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The measured steps, so that a file can be refitted or checked by hand.
        "samples": [[*asdict(shape).values(), round(seconds, 6)] for shape, seconds in zip(recorded, times)],
        "sample_fields": [*StepShape.__dataclass_fields__, "seconds"],
    }
    log(f"calibrated on {len(times)} steps in {model.calibration['seconds']} s: median step error "
        f"{model.calibration['median_relative_error']:.1%}, total {model.calibration['total_time_error']:+.1%}")
    return model

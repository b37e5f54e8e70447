"""Beam search over the paged KV cache, with beams sharing blocks by fork and copy-on-write.

The selection rule is Hugging Face ``transformers``' ``GenerationMixin._beam_search``
(``generation/utils.py``, the vectorized version) with ``early_stopping=False``, so that the
output equals ``model.generate(num_beams=W, do_sample=False, length_penalty=...)``:

1. every running beam's next-token log-softmax (fp32) is added to its running score (the sum of
   its generated tokens' logprobs); the best ``K = 2 * W`` (beam, token) pairs are kept;
2. of the best ``W`` of those, the ones ending in EOS (or reaching ``max_tokens``) become
   finished hypotheses scored ``sum_logprobs / num_generated_tokens ** length_penalty`` (EOS
   counted); the ``W`` best hypotheses are kept;
3. the best ``W`` pairs not ending there become the next running beams;
4. the search ends at ``max_tokens`` or once ``W`` hypotheses are finished and the best
   running beam, normalized by its current length, cannot beat the worst of them.

Memory is the paper's (Kwon et al. 2023, section 4.4, "Beam search"): a new beam is a fork of
the beam it extends (``LLMEngine.fork_request``: its block table with ref count + 1), the beams
that are not extended are aborted (their blocks freed), and a beam that writes into a block
still shared with a sibling copies it first.

Like vLLM's ``LLM.beam_search`` this is a front end: each beam is an engine request (greedy,
EOS ignored, ``W + 1`` logprobs) that ``LLMEngine.step()`` computes with the others; the
search only reads each beam's newest logprobs and chooses whom to fork and abort. It runs on
an idle engine.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.engine.input_processor import PromptType
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.lora.request import LoRARequest


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM ``BeamSearchParams`` names).

    Attributes:
        beam_width: beams kept per step (HF ``num_beams``), >= 1.
        max_tokens: most tokens generated per sequence, >= 1.
        ignore_eos: keep extending beams past EOS (then every sequence has ``max_tokens``).
        length_penalty: a finished sequence's score is ``cum_logprob / len ** length_penalty``
            with ``len`` the generated tokens, EOS included (HF's definition).

    Raises:
        ValueError: naming the field, its value and the allowed range.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float))
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM ``BeamSearchSequence``).

    Attributes:
        tokens: prompt token ids followed by the generated ones (EOS included if it ended so).
        cum_logprob: sum of the generated tokens' logprobs (natural log).
        score: ``cum_logprob / len(generated) ** length_penalty``; sequences are ranked by it.
        text: the decoded ``tokens`` (empty without a tokenizer).
        finish_reason: ``"stop"`` (EOS) or ``"length"``.
    """

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first (vLLM ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    request_id: str  # its engine request
    tokens: list[int]  # prompt + generated
    score: float  # sum of generated logprobs, as the fp32 value the selection computed


@dataclass
class _Group:
    """The beams of one prompt."""

    running: list[_Beam]
    finished: list[tuple[float, BeamSearchSequence]] = field(default_factory=list)
    num_generated: int = 0
    done: bool = False


def beam_search(engine: "LLMEngine", prompts: list["PromptType"],
                params: BeamSearchParams, lora_request: Optional["LoRARequest"] = None) -> list[BeamSearchOutput]:
    """Run beam search for every prompt on ``engine``'s model and KV cache, with the LoRA
    adapter ``lora_request`` (None: the base model; forked beams keep their parent's).

    Prompts run together in waves whose worst-case KV need (``beam_width`` sequences of
    ``prompt + max_tokens`` tokens each) fits the pool and whose beams fit ``max_num_seqs``.

    Returns:
        One ``BeamSearchOutput`` per prompt, in order.

    Raises:
        ValueError: an engine with requests in flight, a bad prompt, ``prompt + max_tokens``
            above ``max_model_len``, ``beam_width`` above ``max_num_seqs``, or one prompt's
            beams needing more blocks than the pool has, or an engine with
            ``speculative_config`` (a step would extend a beam by several tokens, while the
            search selects after every token).
    """
    if engine.args.speculative_config is not None:
        raise ValueError("beam search is not supported with speculative_config: build the LLM without it")
    if engine.has_unfinished_requests():
        raise ValueError("beam search runs on an idle engine: finish or abort the requests in flight first")
    if params.beam_width > engine.args.max_num_seqs:
        raise ValueError(f"beam_width={params.beam_width} is larger than max_num_seqs={engine.args.max_num_seqs}")
    token_lists = [_prompt_token_ids(engine, prompt, params.max_tokens) for prompt in prompts]
    block_size = engine.input_processor.model_info.block_size
    num_blocks = engine.input_processor.model_info.num_blocks
    needs = [params.beam_width * cdiv(len(ids) + params.max_tokens, block_size) for ids in token_lists]
    for need, ids in zip(needs, token_lists):
        if need > num_blocks:
            raise ValueError(f"beam search over a {len(ids)}-token prompt needs up to {need} KV blocks "
                             f"(beam_width={params.beam_width} x {len(ids) + params.max_tokens} tokens) "
                             f"but the KV cache has {num_blocks} blocks of {block_size} tokens")
    search = _BeamSearch(engine, params, lora_request)
    outputs: list[BeamSearchOutput] = []
    start = 0
    while start < len(token_lists):
        end, used = start, 0
        while (end < len(token_lists) and used + needs[end] <= num_blocks
               and (end - start + 1) * params.beam_width <= engine.args.max_num_seqs):
            used += needs[end]
            end += 1
        outputs.extend(search.run(token_lists[start:end]))
        start = end
    return outputs


def _prompt_token_ids(engine: "LLMEngine", prompt: "PromptType", max_tokens: int) -> list[int]:
    """The engine's own tokenization and checks (``InputProcessor``) for one beam prompt."""
    processor = engine.input_processor
    _, token_ids = processor.tokenize(prompt)
    processor.check_prompt_token_ids(token_ids)
    processor.resolve_max_tokens(len(token_ids), max_tokens)
    return token_ids


class _BeamSearch:
    def __init__(self, engine: "LLMEngine", params: BeamSearchParams,
                 lora_request: Optional["LoRARequest"] = None) -> None:
        self.engine = engine
        self.params = params
        self.lora_request = lora_request
        self.vocab_size = engine.input_processor.model_info.vocab_size
        self.eos_token_id = None if params.ignore_eos else engine.eos_token_id
        self._ids = itertools.count()
        # EOS is the search's business, not the engine's: no beam request ends by itself
        # before max_tokens, when the search ends too.
        self._sampling_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                               logprobs=0, output_kind=RequestOutputKind.DELTA)
        # A beam's best W + 1 tokens hold every candidate of HF's best 2W that the selection
        # can take (of W + 1, at most one is EOS). Set after the check on purpose: MAX_LOGPROBS
        # caps what a client's JSON carries, not the sampler.
        self._sampling_params.logprobs = min(params.beam_width + 1, self.vocab_size)

    def _new_id(self) -> str:
        return f"beam-{next(self._ids)}"

    def run(self, token_lists: list[list[int]]) -> list[BeamSearchOutput]:
        groups = []
        try:
            for ids in token_lists:
                beam = _Beam(self._new_id(), list(ids), 0.0)
                groups.append(_Group([beam]))
                self.engine.add_request(beam.request_id, {"prompt_token_ids": ids}, self._sampling_params,
                                        lora_request=self.lora_request)
            while any(not group.done for group in groups):
                newest = {}
                for output in self.engine.step():
                    logprobs = output.outputs[0].logprobs if output.outputs else None
                    if logprobs:
                        newest[output.request_id] = logprobs[-1]
                for group in groups:
                    if group.done:
                        continue
                    got = [beam.request_id in newest for beam in group.running]
                    if any(got) and not all(got):
                        # All beams decode in the same step: they fit max_num_seqs, the token
                        # budget (>= max_num_seqs) and, by the waves' sizing, the pool.
                        raise RuntimeError("beam search fell out of step: a group's beams were not "
                                           "computed together")
                    if all(got):
                        self._select(group, [newest[beam.request_id] for beam in group.running])
        finally:
            self.engine.abort_request([beam.request_id for group in groups for beam in group.running])
            self.engine.step()  # hands out the aborted requests' outputs: the engine is idle again
        return [self._output(group) for group in groups]

    def _select(self, group: _Group, records: list[dict[int, Logprob]]) -> None:
        """One HF beam-search step for ``group``; ``records[i]`` holds running beam ``i``'s
        best next tokens and their fp32 log-softmax values."""
        width = self.params.beam_width
        length_penalty = self.params.length_penalty
        group.num_generated += 1
        num_generated = group.num_generated
        scores = torch.tensor([beam.score for beam in group.running], dtype=torch.float32)
        logprobs = torch.full((len(records), self.vocab_size), -math.inf)
        for row, record in enumerate(records):
            logprobs[row, list(record)] = torch.tensor([entry.logprob for entry in record.values()],
                                                       dtype=torch.float32)
        totals = logprobs + scores[:, None]
        vocab = totals.shape[-1]
        top_values, top_indices = totals.view(-1).topk(min(2 * width, totals.numel()))
        normalized = (top_values / (num_generated ** length_penalty)).tolist()
        values = top_values.tolist()
        at_length = num_generated >= self.params.max_tokens

        new_finished = []
        next_running: list[tuple[int, int, float]] = []
        for rank, (index, value) in enumerate(zip(top_indices.tolist(), values)):
            beam_index, token = divmod(index, vocab)
            hits = at_length or token == self.eos_token_id
            if hits:
                # Only the best `width` candidates may finish; the rest only back up the search.
                if rank < width:
                    new_finished.append((normalized[rank], BeamSearchSequence(
                        tokens=group.running[beam_index].tokens + [token], cum_logprob=value,
                        score=normalized[rank],
                        finish_reason="stop" if token == self.eos_token_id else "length")))
            elif len(next_running) < width:
                next_running.append((beam_index, token, value))
        group.finished = sorted(group.finished + new_finished, key=lambda item: -item[0])[:width]

        if at_length or not next_running:
            group.done = True
        elif len(group.finished) == width:
            best_possible = (torch.tensor(next_running[0][2], dtype=torch.float32)
                             / (num_generated ** length_penalty)).item()
            group.done = not best_possible > min(score for score, _ in group.finished)
        old = group.running
        group.running = []
        if not group.done:
            # Fork the extended beams before aborting the old ones, so that shared blocks survive.
            for beam_index, token, value in next_running:
                parent = old[beam_index]
                child = _Beam(self._new_id(), parent.tokens + [token], value)
                self.engine.fork_request(parent.request_id, child.request_id, token)
                group.running.append(child)
        self.engine.abort_request([beam.request_id for beam in old])

    def _output(self, group: _Group) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        sequences = []
        for _, sequence in group.finished:
            if tokenizer is not None:
                sequence.text = tokenizer.decode(sequence.tokens)
            sequences.append(sequence)
        return BeamSearchOutput(sequences)

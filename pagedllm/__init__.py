"""pagedllm: a CPU-first LLM inference and serving engine built on PagedAttention."""

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams",
           "GuidedDecodingParams", "LoRARequest", "__version__"]

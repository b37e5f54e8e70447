"""``LLM``: the offline API (vLLM ``vllm.LLM``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Optional, Sequence, Union

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheStats
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.utils import check_chat_template_kwargs, template_message


class LLM:
    """Generate text for batches of prompts with the paged engine.

    Takes every ``EngineArgs`` option as a keyword argument, with vLLM's names (for instance
    ``LLM(model=..., dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
    gpu_memory_utilization=0.85)``).

    Raises:
        ValueError: an unknown or unsupported option, or a configuration that cannot run.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (see ``LLMEngine.reset_prefix_cache``); returns True."""
        return self.llm_engine.reset_prefix_cache()

    def get_kv_cache_stats(self) -> KVCacheStats:
        """KV block and token accounting and prefix-cache queries/hits (``KVCacheStats``)."""
        return self.llm_engine.get_kv_cache_stats()

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: BeamSearchParams, lora_request: Optional[LoRARequest] = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt, equal to ``transformers``' ``generate(num_beams=...,
        early_stopping=False)``; beams share KV blocks by fork and copy-on-write.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of those.
            params: beam width, max_tokens, length_penalty, ignore_eos.
            lora_request: the LoRA adapter every beam runs with (``enable_lora``), or None.

        Returns:
            One ``BeamSearchOutput`` per prompt, its ``beam_width`` sequences best first.

        Raises:
            ValueError: see ``pagedllm.beam_search.beam_search``.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {lora_request!r}")
        return beam_search(self.llm_engine, list(prompts), params, lora_request)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Run every prompt to completion, all batched together.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of those.
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar.
            lora_request: a LoRA adapter for all prompts, or one (or None) per prompt
                (``enable_lora``); prompts of different adapters run in the same batches.

        Returns:
            One finished ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: a prompt or parameter that can never run (nothing is left queued then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise ValueError("prompts must be a string, a {'prompt_token_ids': [...]} dict or a list of those, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompts)
        else:
            lora_list = [] if isinstance(lora_request, str) else list(lora_request)
            if isinstance(lora_request, str) or any(not isinstance(r, (LoRARequest, type(None))) for r in lora_list):
                raise ValueError(f"lora_request must be a LoRARequest, None or a list of those, got {lora_request!r}")
            if len(lora_list) != len(prompts):
                raise ValueError(f"got {len(lora_list)} lora_requests for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, lora_list)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
             chat_template: Optional[str] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template.

        Args:
            messages: one conversation (a list of ``{"role", "content"}``) or a list of them.
                ``content`` is text or a list of ``{"type": "text", "text"}`` parts (joined by
                newlines); only an assistant message may leave it out (then it renders as empty
                text), as the server takes messages.
            lora_request: as in ``generate``: one adapter for all, or one per conversation.
            chat_template: a Jinja chat template to use instead of the model's (vLLM's
                argument; a model without one then chats too).
            chat_template_kwargs: the template's own variables (e.g. Qwen3's ``enable_thinking``).
            tools: OpenAI-style tool definitions for templates that take them (vLLM's argument;
                Qwen2.5's lists them in its system prompt, others ignore them). The reply is
                text: parsing tool calls out of it is the server's (``tool_choice``).

        Returns:
            One ``RequestOutput`` per conversation, its ``prompt`` the rendered template text.

        Raises:
            ValueError: no conversation, an empty one, a malformed message (``encode_chat``), or
                a ``chat_template_kwargs`` key that is one of ``apply_chat_template``'s parameters.
        """
        if not messages:
            raise ValueError("messages is empty: give at least one {'role', 'content'} message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(c, (list, tuple)) for c in conversations):
            raise ValueError("messages must be one conversation (a list of {'role', 'content'} dicts) or a list "
                             f"of them, got {messages!r:.200}")
        prompts = []
        for conversation in conversations:
            text, ids = self._render_chat(conversation, add_generation_prompt, continue_final_message,
                                          chat_template, chat_template_kwargs, tools)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def encode_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: Optional[str] = None,
                    chat_template_kwargs: Optional[dict[str, Any]] = None,
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids of a conversation through the chat template (``chat_template``, else the
        model's; special tokens added once; ``tools`` as ``chat`` takes them).

        Raises:
            ValueError: no chat template, an empty conversation, a malformed message (not a dict,
                a role outside ``CHAT_ROLES``, ``content`` missing from a message other than the
                assistant's, or neither text nor a list of text parts), a reserved
                ``chat_template_kwargs`` key, or text too long for ``max_model_len`` (refused
                before it is tokenized).
        """
        return self._render_chat(conversation, add_generation_prompt, continue_final_message, chat_template,
                                 chat_template_kwargs, tools)[1]

    def _render_chat(self, conversation: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                     chat_template: Optional[str], chat_template_kwargs: Optional[dict[str, Any]],
                     tools: Optional[list[dict[str, Any]]]) -> tuple[str, list[int]]:
        """``encode_chat``'s text and token ids."""
        if not conversation:
            raise ValueError("a conversation is empty: give at least one {'role', 'content'} message")
        conversation = [template_message(index, message) for index, message in enumerate(conversation)]
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template (a base model): use generate() with a prompt, "
                             "or pass chat_template")
        kwargs = check_chat_template_kwargs(tokenizer, chat_template_kwargs)
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
        return text, self.llm_engine.input_processor.encode(text, "messages", add_special_tokens=False)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             use_tqdm: bool, lora_list: list[Optional[LoRARequest]]) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = []
        # Only the final outputs are read here: skip building the intermediate ones (vLLM too).
        final_only = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list}
        params_list = [final_only[id(p)] for p in params_list]
        try:
            for prompt, params, lora_request in zip(prompts, params_list, lora_list):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params, lora_request=lora_request)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[request_id] for request_id in request_ids]

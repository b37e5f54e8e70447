"""``POST /v1/completions`` (OpenAI legacy completions; vLLM ``serving_completion.py``)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.protocol import OutputStream
from pagedllm.entrypoints.openai.errors import OpenAIError, sampling_params_error
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, OpenAIServing, SSEResponse, choice_usage,
                                                        collect_final, merge_streams, now_seconds, prompt_logprobs_json,
                                                        run_until_disconnect,
                                                        sse, sse_with_errors, usage)
from pagedllm.outputs import Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Completions: one engine request per prompt; choice ``i * n + j`` is sample ``j`` of
    prompt ``i``. ``echo`` puts the prompt before each choice's text (and, with ``logprobs``,
    the prompt's logprobs before the generated ones; the first prompt token has none)."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Raises: OpenAIError (400 bad field or prompt, 404 model, 429, 503, 504)."""
        self.check_request(request)
        if request.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(400, f"best_of must equal n ({request.n}) or be omitted, got {request.best_of}",
                              param="best_of")
        prompts = self._engine_prompts(request.prompt)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        try:
            params = request.sampling_params(request.max_tokens, request.logprobs, prompt_logprobs)
        except ValueError as exc:
            raise sampling_params_error(exc) from exc
        created = now_seconds()
        submission = await self.submit(raw_request, "cmpl", prompts, params, request.cache_salt, request.priority,
                                       request.model)
        request_id, streams = submission.response_id, submission.streams
        if request.stream:
            chunks = self._stream(request, request_id, created, streams)
            return SSEResponse(sse_with_errors(chunks), submission.close)

        async def respond() -> Response:
            finals = await collect_final(streams)
            return JSONResponse(self._response(request, request_id, created, finals))
        try:
            return await run_until_disconnect(raw_request, respond)
        finally:  # before the response goes out, so that the client's next request sees the refund
            submission.close()

    def _engine_prompts(self, prompt: Any) -> list:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        if isinstance(prompt[0], str):
            return list(prompt)
        return [{"prompt_token_ids": ids} for ids in prompt]

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer is not None else ""

    def _response(self, request: CompletionRequest, request_id: str, created: int,
                  finals: Sequence[RequestOutput]) -> dict:
        choices = []
        for i, output in enumerate(finals):
            prompt_text = self._prompt_text(output) if request.echo else ""
            for completion in output.outputs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(output, completion.token_ids, completion.logprobs or [],
                                              0, include_prompt=request.echo)
                choices.append({"index": i * request.n + completion.index, "text": prompt_text + completion.text,
                                "logprobs": logprobs, "finish_reason": completion.finish_reason,
                                "stop_reason": completion.stop_reason,
                                "prompt_logprobs": prompt_logprobs_json(self, output)})
        return {"id": request_id, "object": "text_completion", "created": created, "model": self.response_model(request.model),
                "choices": choices, "usage": usage(finals)}

    async def _stream(self, request: CompletionRequest, request_id: str, created: int,
                      streams: Sequence[OutputStream]) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        finals: list[Optional[RequestOutput]] = [None] * len(streams)

        def chunk(index: int, text: str, logprobs: Optional[dict], finish_reason: Optional[str],
                  stop_reason: Any = None) -> str:
            body = {"id": request_id, "object": "text_completion", "created": created, "model": self.response_model(request.model),
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}]}
            if request.continuous_usage:  # this choice's prompt and tokens so far
                body["usage"] = choice_usage(finals[index // request.n], index % request.n)
            elif request.include_usage:
                body["usage"] = None
            return sse(body)

        async for i, output in merge_streams(streams):
            finals[i] = output
            for completion in output.outputs:
                index = i * request.n + completion.index
                state = states.setdefault(index, ChoiceState(index))
                if state.finished:
                    continue
                echo = request.echo and not state.started
                text = (self._prompt_text(output) if echo else "") + completion.text[state.num_sent_chars:]
                token_logprobs = (completion.logprobs or [])[state.num_sent_tokens:]
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(output, completion.token_ids[state.num_sent_tokens:],
                                              token_logprobs, state.text_offset, include_prompt=echo)
                if text or token_logprobs or echo:
                    yield chunk(index, text, logprobs, None)
                state.started = True
                state.text_offset += len(text)
                state.num_sent_chars = len(completion.text)
                state.num_sent_tokens = len(completion.token_ids)
                if completion.finish_reason is not None:
                    state.finished = True
                    yield chunk(index, "", None, completion.finish_reason, completion.stop_reason)
        if request.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": self.response_model(request.model), "choices": [], "usage": usage(finals)})

    def _logprobs(self, output: RequestOutput, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  text_offset: int, include_prompt: bool) -> dict:
        """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset) of
        ``token_ids``, after the prompt's when ``include_prompt``; offsets start at ``text_offset``."""
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        positions: list[tuple[int, Optional[dict[int, Logprob]]]] = []
        if include_prompt:
            prompt_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            positions.extend(zip(output.prompt_token_ids, prompt_logprobs))
        positions.extend(zip(token_ids, logprobs))
        offset = text_offset
        for token_id, alternatives in positions:
            token = self.decode_token(token_id, (alternatives or {}).get(token_id))
            result["tokens"].append(token)
            result["text_offset"].append(offset)
            offset += len(token)
            if alternatives is None:
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(alternatives[token_id].logprob)
            result["top_logprobs"].append({self.decode_token(t, lp): lp.logprob for t, lp in alternatives.items()})
        return result

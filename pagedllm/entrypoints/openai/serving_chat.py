"""``POST /v1/chat/completions`` (vLLM ``serving_chat.py``)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, OpenAIError, OpenAIServing, SSEResponse,
                                                        collect_final, merge_streams, now_seconds,
                                                        run_until_disconnect,
                                                        sampling_params_error, sse, sse_with_errors, usage)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.utils import check_utf8


class OpenAIServingChat(OpenAIServing):
    """Chat completions: the messages go through the model's chat template (special tokens
    come from the template only, none are added on top), then one engine request makes the
    ``n`` choices."""

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> tuple[str, list[int]]:
        """The conversation as template text and its token ids.

        Raises:
            OpenAIError 400: no tokenizer or chat template, or the template refused the messages.
        """
        tokenizer = self.require_tokenizer("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template: use /v1/completions")
        template_messages = [m.as_template_message() for m in messages]
        for i, message in enumerate(template_messages):
            for key, value in message.items():
                try:
                    check_utf8(value, f"messages[{i}].{key}")
                except ValueError as exc:
                    raise OpenAIError(400, str(exc), param=f"messages.{i}.{key}") from exc
        try:
            text = tokenizer.apply_chat_template(template_messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
        except Exception as exc:  # noqa: BLE001 - jinja raises anything; it is the input's fault
            raise OpenAIError(400, f"the chat template could not render the messages: {exc}",
                              param="messages") from exc
        return text, self.encode_text(text, "messages", add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Raises: OpenAIError (400 bad field or prompt, 404 model, 429, 503, 504)."""
        self.check_request(request)
        if request.tools:
            raise OpenAIError(400, "tools are not supported", param="tools")
        if request.response_format and request.response_format.get("type", "text") != "text":
            raise OpenAIError(400, f"response_format {request.response_format.get('type')!r} is not "
                                   "supported (only 'text')", param="response_format")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        text, token_ids = self.render(request.messages, request.add_generation_prompt,
                                      request.continue_final_message)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = request.sampling_params(max_tokens, logprobs, request.prompt_logprobs)
        except ValueError as exc:
            error = sampling_params_error(exc)
            if error.param == "logprobs":  # chat's top_logprobs is SamplingParams.logprobs
                error = OpenAIError(400, "top_" + str(exc), param="top_logprobs")
            raise error from exc
        created = now_seconds()
        prompt = {"prompt_token_ids": token_ids, "prompt": text}
        submission = await self.submit(raw_request, "chatcmpl", [prompt], params, request.cache_salt,
                                       request.priority)
        request_id, streams = submission.response_id, submission.streams
        if request.stream:
            chunks = self._stream(request, request_id, created, streams[0])
            return SSEResponse(sse_with_errors(chunks), submission.close)

        async def respond() -> Response:
            (final,) = await collect_final(streams)
            return JSONResponse(self._response(request, request_id, created, final))
        try:
            return await run_until_disconnect(raw_request, respond)
        finally:  # before the response goes out, so that the client's next request sees the refund
            submission.close()

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int,
                  final: RequestOutput) -> dict:
        choices = []
        for completion in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = {"content": self._logprobs(completion.token_ids, completion.logprobs or [],
                                                      request.top_logprobs or 0)}
            choices.append({"index": completion.index,
                            "message": {"role": "assistant", "content": completion.text},
                            "logprobs": logprobs, "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage([final])}

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      stream: RequestStream) -> AsyncIterator[str]:
        def chunk(index: int, delta: dict, logprobs: Optional[dict] = None, finish_reason: Optional[str] = None,
                  stop_reason: Any = None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}]}
            if request.include_usage:
                body["usage"] = None
            return sse(body)

        states = [ChoiceState(index) for index in range(request.n)]
        for state in states:
            yield chunk(state.index, {"role": "assistant", "content": ""})
        final: Optional[RequestOutput] = None
        async for _, output in merge_streams([stream]):
            final = output
            for completion in output.outputs:
                state = states[completion.index]
                if state.finished:
                    continue
                text = completion.text[state.num_sent_chars:]
                token_logprobs = (completion.logprobs or [])[state.num_sent_tokens:]
                if text or (request.logprobs and token_logprobs):
                    logprobs = None
                    if request.logprobs:
                        logprobs = {"content": self._logprobs(completion.token_ids[state.num_sent_tokens:],
                                                              token_logprobs, request.top_logprobs or 0)}
                    yield chunk(state.index, {"content": text}, logprobs)
                state.num_sent_chars = len(completion.text)
                state.num_sent_tokens = len(completion.token_ids)
                if completion.finish_reason is not None:
                    state.finished = True
                    yield chunk(state.index, {}, None, completion.finish_reason, completion.stop_reason)
        if request.include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [], "usage": usage([final])})

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  top_logprobs: int) -> list[dict]:
        """OpenAI chat ``logprobs.content``: per token its text, logprob, UTF-8 bytes and the
        ``top_logprobs`` most likely alternatives (by rank)."""
        content = []
        for token_id, alternatives in zip(token_ids, logprobs):
            token = self.decode_token(token_id, alternatives.get(token_id))
            ranked = sorted((item for item in alternatives.items() if item[1].rank is not None),
                            key=lambda item: item[1].rank)[:top_logprobs]
            content.append({
                "token": token, "logprob": alternatives[token_id].logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (alt := self.decode_token(t, lp)), "logprob": lp.logprob,
                                  "bytes": list(alt.encode())} for t, lp in ranked]})
        return content

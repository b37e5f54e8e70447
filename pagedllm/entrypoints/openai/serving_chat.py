"""``POST /v1/chat/completions`` (vLLM ``serving_chat.py``)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.protocol import OutputStream
from pagedllm.entrypoints.openai.errors import OpenAIError, sampling_params_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_engine import (ChoiceState, OpenAIServing, SSEResponse, choice_usage,
                                                        collect_final, merge_streams, now_seconds, prompt_logprobs_json,
                                                        run_until_disconnect,
                                                        sse, sse_with_errors, usage)
from pagedllm.entrypoints.openai.tool_calls import (ToolCall, check_tools, constraint_schema, held_back, parse_auto,
                                                    parse_forced, template_messages_arguments)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.utils import check_chat_template_kwargs, check_utf8


class OpenAIServingChat(OpenAIServing):
    """Chat completions: the messages go through the model's chat template (special tokens
    come from the template only, none are added on top), then one engine request makes the
    ``n`` choices."""

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               tools: Optional[list[dict]] = None, chat_template: Optional[str] = None,
               chat_template_kwargs: Optional[dict[str, Any]] = None,
               truncate: Optional[int] = None) -> tuple[str, list[int]]:
        """The conversation as template text and its token ids (given ``truncate``, the last
        ``truncate``); ``tools`` go to templates that
        take them (Qwen2.5's lists them in its system prompt; others ignore them);
        ``chat_template_kwargs`` are the template's own variables. Blocks for as long as the
        template and the tokenizer take: handlers call it in a worker thread.

        Raises:
            OpenAIError 400: no tokenizer or chat template, a ``chat_template`` of the request's
                own, a ``chat_template_kwargs`` key that is one of ``apply_chat_template``'s
                parameters, or the template refused the messages.
        """
        if chat_template is not None:
            raise OpenAIError(400, "a chat_template in the request is refused: the server renders with the model's "
                                   "own template (vLLM refuses it too without --trust-request-chat-template)",
                              param="chat_template")
        tokenizer = self.require_tokenizer("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template: use /v1/completions")
        try:
            template_kwargs = check_chat_template_kwargs(tokenizer, chat_template_kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="chat_template_kwargs") from exc
        template_messages = [m.as_template_message() for m in messages]
        for i, message in enumerate(template_messages):
            for key, value in message.items():
                if not isinstance(value, str):
                    continue
                try:
                    check_utf8(value, f"messages[{i}].{key}")
                except ValueError as exc:
                    raise OpenAIError(400, str(exc), param=f"messages.{i}.{key}") from exc
        try:
            template_messages = [template_messages_arguments(m, i) for i, m in enumerate(template_messages)]
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        try:
            text = tokenizer.apply_chat_template(template_messages, tokenize=False, tools=tools,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raises anything; it is the input's fault
            raise OpenAIError(400, f"the chat template could not render the messages: {exc}",
                              param="messages") from exc
        return text, self.encode_text(text, "messages", truncate=truncate, add_special_tokens=False)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Raises: OpenAIError (400 bad field or prompt, 404 model, 429, 503, 504)."""
        self.check_request(request)
        try:
            mode, named = check_tools(request.tools, request.tool_choice)
        except ValueError as exc:
            raise sampling_params_error(exc) from exc
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = request.sampling_params(max_tokens, logprobs, request.prompt_logprobs)
        except ValueError as exc:
            error = sampling_params_error(exc)
            if error.param == "logprobs":  # chat's top_logprobs is SamplingParams.logprobs
                error = OpenAIError(400, "top_" + str(exc), param="top_logprobs")
            elif request.max_completion_tokens is not None and "max_tokens" in str(exc):  # the name it was sent as
                message = str(exc).replace("max_tokens", "max_completion_tokens")
                error = OpenAIError(400, message, param=sampling_params_error(ValueError(message)).param)
            raise error from exc
        text, token_ids = await asyncio.to_thread(self.render, request.messages, request.add_generation_prompt,
                                                  request.continue_final_message,
                                                  request.tools if mode != "none" else None, request.chat_template,
                                                  request.chat_template_kwargs, self.input_processor.truncation(params))
        schema = constraint_schema(request.tools, mode, named, request.parallel_tool_calls)
        if schema is not None:
            if params.structured_outputs is not None:
                raise OpenAIError(400, f"tool_choice {request.tool_choice!r} constrains the reply already: "
                                       "drop response_format / structured_outputs", param="tool_choice")
            # Compact: arguments are for programs, and free whitespace lets a weak model
            # spend max_tokens on it.
            params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        created = now_seconds()
        prompt = {"prompt_token_ids": token_ids, "prompt": text}
        submission = await self.submit(raw_request, "chatcmpl", [prompt], params, request.cache_salt,
                                       request.priority, request.model)
        request_id, streams = submission.response_id, submission.streams
        if request.stream:
            chunks = self._stream(request, request_id, created, streams[0], mode, named, len(token_ids))
            return SSEResponse(sse_with_errors(chunks), submission.close)

        async def respond() -> Response:
            (final,) = await collect_final(streams)
            return JSONResponse(self._response(request, request_id, created, final, mode, named))
        try:
            return await run_until_disconnect(raw_request, respond)
        finally:  # before the response goes out, so that the client's next request sees the refund
            submission.close()

    @staticmethod
    def _echo(request: ChatCompletionRequest) -> str:
        """What ``echo`` puts before each reply, as vLLM: the last message's text when it is the
        assistant's (the reply continues it), else nothing."""
        last = request.messages[-1]
        if not request.echo or last.role != "assistant":
            return ""
        return last.as_template_message()["content"]

    @staticmethod
    def _tool_calls(completion: CompletionOutput, mode: str, named: Optional[dict],
                    parallel: bool) -> tuple[Any, list, Any]:
        """``(content, tool calls, finish_reason)`` of a finished choice. As OpenAI and vLLM:
        ``"tool_calls"`` when the model chose to call (auto, required), ``"stop"`` for a named
        function. Cut by ``max_tokens``: an ``auto`` reply that does not parse stays text; a
        ``required`` or named one keeps each call whose name was generated, with the arguments
        generated so far, and no content (the forced JSON is pagedllm's own, not the model's
        words). Not ``parallel`` (``parallel_tool_calls: false``): an ``auto`` reply's first call
        only (a ``required`` one is constrained to one already)."""
        if mode == "none":
            return completion.text, [], completion.finish_reason
        if mode == "auto":
            content, calls = parse_auto(completion.text)
            calls = calls if parallel else calls[:1]
        else:
            content, calls = None, parse_forced(completion.text, mode, named)
        finish_reason = completion.finish_reason
        if calls and mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int,
                  final: RequestOutput, mode: str, named: Optional[dict]) -> dict:
        choices = []
        for completion in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = {"content": self._logprobs(completion.token_ids, completion.logprobs or [],
                                                      request.top_logprobs or 0)}
            content, calls, finish_reason = self._tool_calls(completion, mode, named, request.parallel_tool_calls)
            if content is not None:
                content = self._echo(request) + content
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
            choices.append({"index": completion.index, "message": message,
                            "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": completion.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self.response_model(request.model),
                "choices": choices, "usage": usage([final]), "prompt_logprobs": prompt_logprobs_json(self, final)}

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      stream: OutputStream, mode: str = "none",
                      named: Optional[dict] = None, num_prompt_tokens: int = 0) -> AsyncIterator[str]:
        """Chunks as OpenAI streams them. With tools: a named function's arguments stream as
        ``delta.tool_calls[0].function.arguments`` pieces (the first delta carries id, type
        and name), and so do each of ``required``'s calls, as the array is generated; ``auto``
        streams content until a ``<tool_call>`` begins and sends each parsed call as one delta
        when the choice ends."""
        def chunk(index: int, delta: dict, logprobs: Optional[dict] = None, finish_reason: Optional[str] = None,
                  stop_reason: Any = None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.response_model(request.model),
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}]}
            if request.continuous_usage:  # this choice's prompt and tokens so far
                body["usage"] = choice_usage(final, index, num_prompt_tokens)
            elif request.include_usage:
                body["usage"] = None
            return sse(body)

        final: Optional[RequestOutput] = None
        states = [ChoiceState(index) for index in range(request.n)]
        echo = self._echo(request)
        for state in states:
            yield chunk(state.index, {"role": "assistant", "content": ""})
            if echo:
                yield chunk(state.index, {"content": echo})
        async for _, output in merge_streams([stream]):
            final = output
            for completion in output.outputs:
                state = states[completion.index]
                if state.finished:
                    continue
                if mode != "none":
                    for event in self._stream_tools(state, completion, mode, named, chunk, request.parallel_tool_calls):
                        yield event
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
                       "model": self.response_model(request.model), "choices": [], "usage": usage([final])})

    def _stream_tools(self, state: ChoiceState, completion: CompletionOutput, mode: str,
                      named: Optional[dict], chunk: Any, parallel: bool) -> list[str]:
        """The chunks of one choice's new output under ``tools`` (see ``_stream``)."""
        events = []
        text = completion.text
        if mode == "named":
            if not state.started and text:
                call = ToolCall(named["name"], "").as_openai(index=0)
                events.append(chunk(state.index, {"tool_calls": [call]}))
                state.started = True
            if text[state.num_sent_chars:]:
                events.append(chunk(state.index, {"tool_calls": [
                    {"index": 0, "function": {"arguments": text[state.num_sent_chars:]}}]}))
            state.num_sent_chars = len(text)
        elif mode == "required":
            for index, call in enumerate(parse_forced(text, mode, named)):
                if index == len(state.sent_arguments):
                    header = call.as_openai(index)
                    header["function"]["arguments"] = ""
                    events.append(chunk(state.index, {"tool_calls": [header]}))
                    state.sent_arguments.append(0)
                piece = call.arguments[state.sent_arguments[index]:]
                if piece:
                    events.append(chunk(state.index, {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}))
                    state.sent_arguments[index] = len(call.arguments)
        elif mode == "auto" and not state.started:
            # Content streams until a tool call may begin; from there the choice is held.
            start = text.find("<tool_call>")
            end = start if start >= 0 else len(text) - held_back(text)
            if end > state.num_sent_chars:
                events.append(chunk(state.index, {"content": text[state.num_sent_chars:end]}))
                state.num_sent_chars = end
            state.started = start >= 0
        if completion.finish_reason is None:
            return events
        state.finished = True
        content, calls, finish_reason = self._tool_calls(completion, mode, named, parallel)
        if mode == "auto":
            if calls:
                events.extend(chunk(state.index, {"tool_calls": [call.as_openai(index)]})
                              for index, call in enumerate(calls))
            elif text[state.num_sent_chars:]:
                events.append(chunk(state.index, {"content": text[state.num_sent_chars:]}))
        events.append(chunk(state.index, {}, None, finish_reason, completion.stop_reason))
        return events

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  top_logprobs: int) -> list[dict]:
        """OpenAI chat ``logprobs.content``: per token its text, logprob, bytes (``token_bytes``) and the
        ``top_logprobs`` most likely alternatives (by rank)."""
        content = []
        for token_id, alternatives in zip(token_ids, logprobs):
            token = self.decode_token(token_id, alternatives.get(token_id))
            ranked = sorted((item for item in alternatives.items() if item[1].rank is not None),
                            key=lambda item: item[1].rank)[:top_logprobs]
            content.append({
                "token": token, "logprob": alternatives[token_id].logprob,
                "bytes": self.token_bytes(token_id, alternatives.get(token_id)),
                "top_logprobs": [{"token": self.decode_token(t, lp), "logprob": lp.logprob,
                                  "bytes": self.token_bytes(t, lp)} for t, lp in ranked]})
        return content

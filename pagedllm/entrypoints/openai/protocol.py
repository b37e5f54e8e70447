"""Request bodies of the OpenAI-compatible API (pydantic), and their ``SamplingParams``.

Field names and defaults follow the OpenAI API reference (completions, chat completions) plus
the non-OpenAI sampling fields vLLM accepts in the body (``vllm/entrypoints/openai/protocol.py``):
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, cache_salt, ...
Structured outputs come as OpenAI's ``response_format`` (``json_object``, ``json_schema``) or
vLLM's ``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields; one of these per request.
Unknown fields are accepted, ignored and logged, as vLLM does (``use_beam_search: true`` is
refused: ``OpenAIServing.check_request``). Ranges are checked once, by
``SamplingParams``, whose ``ValueError`` names the field, the limit and the value.

JSON types are checked as OpenAI checks them, not as pydantic's lax mode would coerce them:
an integer field takes JSON integers only (not ``"5"``, ``true`` or ``5.0``), a number field
takes integers and floats (not strings or booleans), a boolean field takes ``true``/``false``
only (not ``1`` or ``"yes"``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, model_validator

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


Int = StrictInt
Float = Annotated[float, Strict()]  # JSON integers are numbers too
Bool = StrictBool
# OpenAI's range for a logit_bias value (its API rejects others; SamplingParams takes any number).
LogitBias = Annotated[float, Strict(), Field(ge=-100, le=100)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: a last chunk with the usage (OpenAI's); ``continuous_usage_stats``
    (vLLM's): with ``include_usage``, every chunk carries its choice's usage so far too."""

    include_usage: Optional[Bool] = False
    continuous_usage_stats: Optional[Bool] = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: Int = 1
    stream: Bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[Int] = None
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: Optional[dict[str, LogitBias]] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[Int] = None
    min_p: Optional[Float] = None
    repetition_penalty: Optional[Float] = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: Optional[list[Int]] = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    allowed_token_ids: Optional[list[Int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[Int] = None
    truncate_prompt_tokens: Optional[Int] = None  # keep the prompt's last k tokens (SamplingParams')
    cache_salt: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    priority: Optional[Int] = None  # vLLM's: lower runs first under --scheduling-policy priority

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int]) -> SamplingParams:
        """The request as ``SamplingParams`` (cumulative outputs, which the server streams from).

        Raises:
            ValueError: a field out of range (from ``SamplingParams``).
        """
        optional = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                           "repetition_penalty")
                    if getattr(self, name) is not None}
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(), **optional)

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's constraint from whichever of its fields carries one (None: no field).

        Raises:
            ValueError: several fields given, or one malformed; the message starts with the
                field's name (which the 400 reports as ``param``).
        """
        given: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        guided = {kind: getattr(self, "guided_" + kind) for kind in ("json", "regex", "choice", "grammar")
                  if getattr(self, "guided_" + kind) is not None}
        if guided:
            given.append(("guided_" + next(iter(guided)), guided))
        response_format = self.response_format_params()
        if response_format is not None:
            given.append(("response_format", response_format))
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{given[1][0]} conflicts with {given[0][0]}: give one structured output "
                             "constraint per request")
        name, fields = given[0]
        try:
            if name == "structured_outputs":
                return SamplingParams(structured_outputs=fields).structured_outputs
            return StructuredOutputsParams(**fields)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    def response_format_params(self) -> Optional[dict[str, Any]]:
        """OpenAI's ``response_format`` as ``StructuredOutputsParams`` fields, None for
        ``{"type": "text"}`` or no field.

        Raises:
            ValueError: another type, or a ``json_schema`` without a ``schema`` object.
        """
        response_format = self.response_format
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            json_schema = response_format.get("json_schema")
            if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
                raise ValueError("response_format of type 'json_schema' needs json_schema.schema, a JSON "
                                 f"schema object; got json_schema={json_schema!r}")
            return {"json": json_schema["schema"]}
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries its choice's usage so far (vLLM's ``continuous_usage_stats``,
        which takes effect with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list
    of token id lists. ``max_tokens`` absent means 16 (OpenAI's default); an explicit null
    means the rest of the context."""

    prompt: Union[list[Int], list[list[Int]], str, list[str]]
    max_tokens: Optional[Int] = 16
    echo: Bool = False
    logprobs: Optional[Int] = None
    best_of: Optional[Int] = None
    suffix: Optional[str] = None


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """One chat message. As OpenAI's API: the roles below only, and ``content`` required except
    for an assistant message (which may carry only a name or tool calls)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # utils.CHAT_ROLES (LLM.chat's)
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs 'content'")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as a chat template expects it (text parts joined by newlines, as vLLM)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; absent both, the reply may fill the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int] = None
    max_completion_tokens: Optional[Int] = None
    logprobs: Bool = False
    top_logprobs: Optional[Int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Bool = True  # false: at most one call per choice (OpenAI's)
    # vLLM extensions: echo puts the last message before the reply when it is the assistant's
    # (continue_final_message); chat_template_kwargs are the template's own variables
    # (enable_thinking, ...); a chat_template of the request's own is refused, as vLLM refuses
    # it without --trust-request-chat-template.
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    echo: Bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (through the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: Optional[str] = None
    tokens: list[Int]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): load the PEFT folder ``lora_path`` as the
    model ``lora_name``; ``load_inplace`` replaces an adapter already of that name."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    load_inplace: Bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: Optional[int] = None

"""OpenAI-compatible request bodies, and OpenAI's error format.

Bodies are strict (a string where a number belongs is a 400, as OpenAI answers, not a silent
coercion) and carry their ranges and list lengths in the schema, so the OpenAPI document that
FastAPI serves tells clients and fuzzers what is valid, and no list can make the server loop over
millions of items. Unknown fields are ignored, as OpenAI's server does; fields OpenAI defines that
iterserve does not implement are refused by name (UNSUPPORTED_FIELDS), never silently ignored.
Cross-field rules (stop strings, limits that depend on the model) are checked when a body becomes
SamplingParams.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from iterserve.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

INT64_MIN, UINT64_MAX, INT32_MAX = -(2**63), 2**64 - 1, 2**31 - 1
# list caps: generous for any real use, small enough that validating a body stays cheap
MAX_TOKEN_IDS = 1 << 17  # a prompt given as token ids, /detokenize's tokens (longer than any context)
MAX_STOP = 16  # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_TOOLS = 128  # OpenAI's limit
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit
MAX_METADATA = 16  # OpenAI's limit (Responses' metadata)


def _integral(value):
    """JSON Schema counts 2.0 as an integer; strict pydantic would not. Any other float stays a float
    and fails as one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
TokenIds = Annotated[list[Int], Field(max_length=MAX_TOKEN_IDS)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


MAX_N = 64  # parallel samples per request (each is a sequence of its own in the batch)


class StreamOptions(StrictModel):
    include_usage: bool | None = False


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(StrictModel):
    """vLLM's `structured_outputs` extra parameter; give exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: str | dict | None = Field(None, alias="json", description="a JSON schema (object or its JSON text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="Lark or GBNF (llama.cpp EBNF) grammar text")
    json_object: bool | None = None


class PredictionText(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's predicted output: text the answer is expected to share much of (the file being
    edited); drafts for speculative decoding come from it, and the answer is the model's own."""
    type: Literal["content"]
    content: str | Annotated[list[PredictionText], Field(max_length=MAX_CONTENT_PARTS)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class GenerationRequest(StrictModel):
    """Fields both generation endpoints share; None means "the default". Extra fields are kept (not
    validated) so that UNSUPPORTED_FIELDS can refuse the ones OpenAI defines and iterserve does not
    implement."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=INT32_MAX, description="extension: 0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    seed: Int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)]
           | None) = None
    stop_token_ids: list[Int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description="extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             description="extension")
    n: Int | None = Field(1, ge=1, le=MAX_N, description="choices to generate; they share the prompt's KV blocks")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="extension: keep generating past end-of-sequence")
    priority: Int | None = Field(0, ge=INT64_MIN, le=UINT64_MAX,
                                 description="extension: lower runs first under --scheduling-policy priority")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias in [-100, 100]")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = Field(None, description="extension (vLLM)")
    guided_json: str | dict | None = Field(None, description="extension (vLLM, older name)")
    guided_regex: str | None = Field(None, description="extension (vLLM, older name)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM, older name)")
    guided_grammar: str | None = Field(None, description="extension (vLLM, older name)")
    prompt_logprobs: Int | None = Field(None, ge=0, le=20, description="extension (vLLM): each prompt token's "
                                        "logprob (the first null) and the top k at its position")
    prediction: Prediction | None = None


class CompletionRequest(GenerationRequest):
    prompt: (str | Annotated[list[str], Field(max_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(max_length=1)])
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool | None = Field(False, description="the prompt before the completion, in the text and (with "
                                                  "logprobs) in the logprobs, the first token's null")
    suffix: str | None = None
    best_of: Int | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this result answers


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description='false: tool_choice "required" makes one call')
    # reasoning models (vLLM's names): template switches, the thinking budget, whether to answer the thinking
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension (vLLM): extra variables for the chat template, e.g. {\"enable_thinking\": false}; "
                          "over the server's --default-chat-template-kwargs")
    thinking_token_budget: Int | None = Field(
        None, ge=-1, le=INT32_MAX, description="extension (vLLM): thinking tokens before the end-of-thinking marker "
                                               "is forced (-1: unlimited; default --reasoning-budget); needs "
                                               "--reasoning-parser")
    include_reasoning: bool | None = Field(True, description="extension (vLLM): false leaves the thinking out of "
                                                             "the answer")


class EmbeddingRequest(StrictModel):
    """OpenAI's /v1/embeddings body. Extra fields are kept, as in GenerationRequest."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str | None = None
    input: (str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)] | TokenIds
            | Annotated[list[TokenIds], Field(max_length=MAX_EMBEDDING_INPUTS)])
    dimensions: Int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="keep this many dimensions (models trained for it: Matryoshka)")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="base64: each vector's little-endian float32 bytes")
    user: str | None = None
    priority: Int | None = Field(0, ge=INT64_MIN, le=UINT64_MAX,
                                 description="extension: lower runs first under --scheduling-policy priority")


# ---- the Responses API ---------------------------------------------------------------------------------
class ResponseContentPart(StrictModel):
    """A part of a message's content; only text parts are served (others are refused by type)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str = Field(description="input_text or output_text (text only)")
    text: str | None = None


class ResponseInputItem(StrictModel):
    """One item of `input`: a message (type "message" or none), an earlier `function_call`, or a
    `function_call_output`. Which fields apply depends on the type (checked when the body is read)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | Annotated[list[ResponseContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | Annotated[list[ResponseContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    id: str | None = None
    status: str | None = None


class ResponseTool(StrictModel):
    """A tool: function tools are served; built-in ones (web_search, file_search ...) are refused by type."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponseToolChoice(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    name: str | None = None


class ResponseTextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(StrictModel):
    """OpenAI's /v1/responses body. It becomes a chat request (the chat path's models, limits and
    tool handling); fields OpenAI defines that iterserve does not implement are refused by name
    (RESPONSES_UNSUPPORTED_FIELDS)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    model: str | None = None
    input: str | Annotated[list[ResponseInputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    text: ResponseText | None = None
    tools: list[ResponseTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = Field(True, description="keep the response for previous_response_id and GET "
                                                 "(bounded in memory: --responses-store-size, --responses-store-ttl)")
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # extensions (as on the chat route)
    seed: Int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX, description="extension")
    top_k: Int | None = Field(None, ge=-1, le=INT32_MAX, description="extension: 0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             description="extension")
    priority: Int | None = Field(0, ge=INT64_MIN, le=UINT64_MAX,
                                 description="extension: lower runs first under --scheduling-policy priority")


class LoadLoRAAdapterRequest(StrictModel):
    """vLLM's /v1/load_lora_adapter body: a PEFT adapter folder on the server's machine, and the
    name requests will give as `model`."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1, max_length=256)


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extension (vLLM): with messages, as on "
                                                                          "chat completions")


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: TokenIds


# ---- fields OpenAI defines that iterserve does not implement ----------------------------------------
@dataclass(frozen=True)
class Unsupported:
    """A request field refused with a 400 naming it, unless its value is one that asks for nothing."""

    field: str
    accepts: Callable[[Any], bool] = lambda value: value is None  # values that mean "not used"
    hint: str = ""


def _off(value) -> bool:
    return value is None or value == [] or value == {} or value is False


# One line per field; delete a line when the field gets implemented.
UNSUPPORTED_FIELDS: tuple[Unsupported, ...] = (
    Unsupported("functions", _off),
    Unsupported("function_call", lambda v: v in (None, "none")),
    Unsupported("suffix", lambda v: v in (None, "")),
    Unsupported("best_of", lambda v: v in (None, 1), "only 1; n > 1 returns every sample"),
    Unsupported("audio", _off),
    Unsupported("modalities", lambda v: v in (None, ["text"]), "only [\"text\"]"),
    Unsupported("web_search_options", _off),
    Unsupported("reasoning_effort", lambda v: v is None, "switch thinking with chat_template_kwargs (e.g. "
                "enable_thinking) and cap it with thinking_token_budget"),
    # vLLM's older structured-output knobs (the constraints themselves are implemented)
    Unsupported("guided_whitespace_pattern", _off),
    Unsupported("guided_decoding_backend", lambda v: v in (None, "auto", "guidance", "llguidance"),
                "the grammar engine is llguidance"),
)


def _no_reasoning(value) -> bool:
    return _off(value) or (isinstance(value, dict) and all(v is None for v in value.values()))


# the Responses API's own (its tools and input items are checked by type where they are read)
RESPONSES_UNSUPPORTED_FIELDS: tuple[Unsupported, ...] = (
    Unsupported("reasoning", _no_reasoning, "reasoning effort and summaries are not implemented; with "
                "--reasoning-parser the thinking comes as a reasoning item"),
    Unsupported("background", _off),
    Unsupported("include", _off),
    Unsupported("conversation", _off, "use previous_response_id"),
    Unsupported("prompt", _off),
    Unsupported("truncation", lambda v: v in (None, "disabled"), "only \"disabled\": a request that does not "
                "fit is refused"),
    Unsupported("max_tool_calls", lambda v: v is None),
    Unsupported("top_logprobs", lambda v: v in (None, 0)),
    Unsupported("service_tier", lambda v: v in (None, "auto", "default")),
    Unsupported("prompt_cache_key", lambda v: v is None, "prefix caching is automatic"),
    Unsupported("prompt_cache_retention", lambda v: v is None),
    Unsupported("text.verbosity", lambda v: v is None),
)


def unsupported_field(body: BaseModel, fields: tuple[Unsupported, ...] = UNSUPPORTED_FIELDS) -> APIError | None:
    """The error for the first unsupported field the body uses, or None (`a.b`: field b of field a)."""
    for u in fields:
        obj, name = body, u.field
        if "." in name:
            head, name = name.split(".", 1)
            obj = getattr(body, head, None)
            if obj is None:
                continue
        extra = obj.model_extra or {}
        value = getattr(obj, name) if name in type(obj).model_fields else extra.get(name)
        if not u.accepts(value):
            hint = f" ({u.hint})" if u.hint else ""
            return APIError(f"{u.field} is not supported by this server{hint}", param=u.field,
                            code="unsupported_field")
    return None


# ---- errors ----------------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               500: "server_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error the client caused or must wait out; becomes OpenAI's JSON error body."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, status_code: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status_code, "server_error"),
                      "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """First pydantic error as one readable line plus the parameter it concerns."""
    if not errors:
        return "invalid request body", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else f"request body: {msg}") + more, param

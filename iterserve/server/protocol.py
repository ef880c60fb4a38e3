"""OpenAI-compatible request bodies, and OpenAI's error format.

Bodies are strict (a string where a number belongs is a 400, as OpenAI answers, not a silent
coercion) and carry their ranges in the schema, so the OpenAPI document that FastAPI serves tells
clients and fuzzers what is valid. Unknown fields are ignored, as vLLM does. Cross-field rules
(n, echo, stop strings, limits that depend on the model) are checked when a body becomes
SamplingParams.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

INT64_MIN, UINT64_MAX, INT32_MAX = -(2**63), 2**64 - 1, 2**31 - 1


def _integral(value):
    """JSON Schema counts 2.0 as an integer; strict pydantic would not. Any other float stays a float
    and fails as one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


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


class GenerationRequest(StrictModel):
    """Fields both generation endpoints share; None means "the default"."""

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=INT32_MAX, description="extension: 0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    seed: Int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = Field(None, description="extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, description="extension")
    n: Int | None = Field(1, ge=1, le=MAX_N, description="choices to generate; they share the prompt's KV blocks")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="extension: keep generating past end-of-sequence")
    priority: Int | None = Field(0, ge=INT64_MIN, le=UINT64_MAX,
                                 description="extension: lower runs first under --scheduling-policy priority")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = Field(None, description="extension (vLLM)")
    guided_json: str | dict | None = Field(None, description="extension (vLLM, older name)")
    guided_regex: str | None = Field(None, description="extension (vLLM, older name)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM, older name)")
    guided_grammar: str | None = Field(None, description="extension (vLLM, older name)")


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
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
    content: str | list[TextPart] | None = None
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
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description='false: tool_choice "required" makes one call')


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Int]


# ---- errors ----------------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               503: "server_overloaded"}


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

"""Anthropic's Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) and its error shape.

The bodies are as strict as Anthropic's own: a field nobody defines is a 400 ("Extra inputs are not
permitted", Anthropic's answer), and a field or content block Anthropic defines that iterserve does
not serve is a 400 that names it (MESSAGES_UNSUPPORTED_FIELDS, UNSUPPORTED_BLOCKS), never silently
dropped. Content blocks and tools are read as plain objects here and checked by type where they are
turned into the chat request (anthropic_messages.py), so that an image block is refused as "not
supported" rather than as a schema mismatch.

`cache_control` is accepted everywhere Anthropic allows it and does nothing: prefix caching is
automatic here (every request shares the KV blocks of any prefix already computed), so the hint
asks for nothing the server does not already do, and Claude Code sends it on nearly every request.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from iterserve.server.protocol import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS, MAX_TOOLS, Int,
                                       StrictModel)

MESSAGES_PATH = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); 503 is ours for a
# full queue or a stopping server, which Anthropic calls overloaded (its own status there is 529)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                         413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Routes whose errors take Anthropic's shape (OpenAI routes keep OpenAI's)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_type(status_code: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")


def anthropic_error_body(message: str, status_code: int) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status_code), "message": message}}


class AnthropicModel(StrictModel):
    """Strict as everywhere (no coercion); unknown fields are kept so that they can be refused by
    name, or as Anthropic refuses them (MessagesRequest.extra_fields_error)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class CacheControl(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = Field(None, max_length=0, description="not supported: only null or []")


Block = Annotated[dict[str, Any], Field(description="a content block: text, tool_use (assistant), tool_result "
                                                    "(user), thinking / redacted_thinking (assistant)")]


class MessageParam(StrictModel):
    """A turn; a `system` turn (text only) is an instruction in the middle of the conversation."""
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[Block], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]


class ToolChoice(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    user_id: str | None = Field(None, max_length=256)


class Thinking(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(StrictModel):
    """`format` constrains the answer to a JSON schema (the structured-output path); `effort` is a
    reasoning-depth hint, refused when set (no reasoning switch here)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


# ---- blocks and tools, validated one by one where the body is read (anthropic_messages.py) ----------
class Caller(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["direct"] = Field(description="only direct: no code-execution callers here")


class ToolUseBlock(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: str
    id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,256}$")
    name: str = Field(min_length=1, max_length=256)
    input: dict
    cache_control: CacheControl | None = None
    caller: Caller | None = None
    toolset_name: None = Field(None, description="no toolsets here")


class ToolResultBlock(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: str
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[dict] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: None = Field(None, description="no toolsets here")


class ThinkingBlock(StrictModel):
    """An earlier turn's thinking (thinking or redacted_thinking): accepted and left out of the prompt,
    as Anthropic leaves earlier turns' thinking out of the context for most models; the chat path has
    no place for it."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: str
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking


class AnthropicTool(StrictModel):
    """A custom (client) tool. `strict` is passed on; `eager_input_streaming` asks for what the stream
    does anyway (a forced call's input streams as it is made); the rest are refused unless unused."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: str | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: Literal[False] | None = Field(None, description="no tool search here")
    allowed_callers: list[Literal["direct"]] | None = Field(None, description="only direct")
    input_examples: list = Field([], max_length=0, description="not supported: only []")


class CountTokensRequest(AnthropicModel):
    """`/v1/messages/count_tokens`: what the prompt is made of, without the sampling fields."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[Block], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    speed: Literal["standard"] | None = Field(None, description="only standard: there is one speed here")
    cache_control: CacheControl | None = Field(None, description="accepted, a no-op: prefix caching is automatic")
    user_profile_id: str | None = Field(None, max_length=256, description="accepted: attribution only")
    workspace_id: str | None = Field(None, max_length=256, description="accepted: there is one workspace here")


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`: Anthropic's body; `max_tokens` is required, as Anthropic requires it."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description="accepted: there is one tier here")
    output_format: JsonOutputFormat | None = Field(None, description="the older (beta) name of output_config.format")


# Fields Anthropic defines that iterserve does not serve: refused by name unless the value asks for
# nothing. Field -> (accepts, hint). Any other unknown field gets Anthropic's own "Extra inputs".
def _off(value) -> bool:
    return value is None or value == [] or value == {}


def _no_values(value) -> bool:
    return _off(value) or (isinstance(value, dict) and all(v is None for v in value.values()))


MESSAGES_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "container": (_off, "no code-execution containers here"),
    "mcp_servers": (_off, "connect MCP servers in the client"),
    "context_management": (_off, "the client must trim its own context"),
    "diagnostics": (_no_values, "no prompt-cache diagnostics"),
    "inference_geo": (_off, "the server runs where it runs"),
}

# content block types Anthropic defines and iterserve does not serve (text-only models, no server tools)
UNSUPPORTED_BLOCKS = frozenset({
    "image", "document", "search_result", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
    "code_execution_tool_result", "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
    "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload", "tool_reference"})

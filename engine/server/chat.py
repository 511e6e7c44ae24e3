"""The OpenAI chat completions wire format: parsing a POST /v1/chat/completions body (a
400-worthy `InvalidRequestError` naming the field at the first bad value), rendering the
conversation through the model's chat template into prompt segments (cacheable parts
stay whole segments, so position-independent caching applies through the chat API), and
building the JSON of responses and stream chunks.

Accepted body (besides the sampling fields of engine.server.protocol: `temperature`,
`top_p`, `stop`, `seed`, `stream`, `stream_options`, `n`, penalties, `logit_bias`,
`model`, `user`):

| field | type | notes |
|---|---|---|
| `messages` | non-empty list of `{"role": str, "content": str or list of parts}` | |
| content part | `{"type": "text", "text": str, "cache": bool}` | `cache`: extension (default false); other types: 400 |
| message `cache` | bool | extension: `true` marks a string `content` as one cacheable part |
| `max_tokens` / `max_completion_tokens` | int >= 1 | default: to the end of the context (or the cache's room) |
| `logprobs` | false/null only | `top_logprobs`, `tools`, `tool_choice`, `functions`: not supported, refused when set |
| `response_format` | `{"type": "text"}` or null | another format is a 400 |
| `chat_template_kwargs` | object | extension (as vLLM's): extra variables for the template, e.g. `{"enable_thinking": false}` |

Rendering rule (how a conversation becomes segments):
1. Each message's content parts are joined, with nothing between them, into one string;
   each cacheable part enters that string as a unique placeholder (a random nonce per
   request), not as its text.
2. The template renders the conversation with `add_generation_prompt=True`: the
   checkpoint's own chat template (engine.models.hf.tokenizer.CheckpointTokenizer, the
   tokenizer's BOS text removed from the front since the engine adds the BOS token);
   a checkpoint without a template is a 400; the presets (byte tokenizer, no template)
   use FALLBACK_TEMPLATE: one `role: content` line per message, then `assistant: `.
3. The rendered text is cut at the placeholders: each stretch between them (the
   template's own text plus uncached parts) becomes one uncached segment (empty ones are
   dropped), each placeholder one cached segment holding the part's text verbatim.
4. The engine tokenizes every segment alone, so a cacheable part's tokens are the same in
   any conversation, at any position (no BPE merge crosses its edges), and its cached
   state is found again wherever it recurs. A template's filters on the content (trim,
   split) see the placeholder, never the part's text.
5. Each placeholder must appear in the rendered text exactly once; a template that drops,
   repeats or rewrites a cacheable part is a 400 naming the part.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.errors import InvalidRequestError, TokenizerError
from engine.server.protocol import SamplingFields, parse_sampling_fields
from engine.tokenizer import Tokenizer

#: variables the server sets itself; `chat_template_kwargs` may not override them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                         "pad_token", "unk_token"})

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class ChatPart:
    """One text part of a message's content; `cache`: reusable wherever it recurs."""

    text: str
    cache: bool


@dataclass(frozen=True)
class ChatMessage:
    role: str
    parts: tuple[ChatPart, ...]


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat completions request."""

    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    max_tokens_field: str  # where max_tokens came from, for messages naming it
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


def _parse_part(raw: Any, where: str) -> ChatPart:
    if not isinstance(raw, dict):
        raise InvalidRequestError(where, f"must be a content part object, got {type(raw).__name__}")
    kind = raw.get("type", "text")
    if kind != "text":
        raise InvalidRequestError(f"{where}.type", f"only text parts are supported, got {kind!r}")
    text = raw.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text", f"must be a string, got {type(text).__name__}")
    cache = raw.get("cache", False)
    if not isinstance(cache, bool):
        raise InvalidRequestError(f"{where}.cache", f"must be true or false, got {cache!r}")
    return ChatPart(text, cache)


def _parse_message(raw: Any, where: str) -> ChatMessage:
    if not isinstance(raw, dict):
        raise InvalidRequestError(where, f"must be a message object with role and content, got {type(raw).__name__}")
    role = raw.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(f"{where}.role", f"must be a non-empty string, got {role!r}")
    if raw.get("tool_calls") or raw.get("function_call"):
        raise InvalidRequestError(f"{where}.tool_calls", "tool calls are not supported")
    cache = raw.get("cache", False)
    if not isinstance(cache, bool):
        raise InvalidRequestError(f"{where}.cache", f"must be true or false, got {cache!r}")
    content = raw.get("content")
    if isinstance(content, str):
        return ChatMessage(role, (ChatPart(content, cache),))
    if cache:
        raise InvalidRequestError(f"{where}.cache", "marks a string content only; mark each part of a list instead")
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content", f"must be a string or a list of text parts, got {content!r}")
    return ChatMessage(role, tuple(_parse_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)))


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise `InvalidRequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
    messages = tuple(_parse_message(m, f"messages[{i}]") for i, m in enumerate(raw))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise InvalidRequestError("max_tokens", "give at most one of max_tokens or max_completion_tokens")
    where = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = parse_sampling_fields(body, where)
    if body.get("logprobs") not in (None, False):
        raise InvalidRequestError("logprobs", "is not supported")
    for name in ("top_logprobs", "tools", "tool_choice", "functions", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise InvalidRequestError(name, "is not supported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequestError("response_format", f'only {{"type": "text"}} is supported, got {fmt!r}')
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", f"must be an object, got {kwargs!r}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs.{reserved[0]}", "is set by the server")
    return ChatRequest(messages, sampling, where, dict(kwargs))


def render_segments(tokenizer: Tokenizer, messages: tuple[ChatMessage, ...],
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """The conversation as prompt segments `[{"text", "cache"}, ...]` by the rendering rule
    of the module docstring (`template_kwargs`: extra template variables);
    `InvalidRequestError` when the template refuses it."""
    from engine.models.hf.tokenizer import CheckpointTokenizer, compile_chat_template

    nonce = uuid.uuid4().hex
    cached: dict[str, tuple[str, str]] = {}  # placeholder -> (text, where)
    rendered_messages = []
    for i, msg in enumerate(messages):
        pieces = []
        for j, part in enumerate(msg.parts):
            if part.cache and part.text:
                mark = f"<|kvengine-part-{nonce}-{len(cached)}|>"
                cached[mark] = (part.text, f"messages[{i}].content" + (f"[{j}]" if len(msg.parts) > 1 else ""))
                pieces.append(mark)
            else:
                pieces.append(part.text)
        rendered_messages.append({"role": msg.role, "content": "".join(pieces)})
    try:
        if isinstance(tokenizer, CheckpointTokenizer):
            if tokenizer.chat_template_source is None:
                raise InvalidRequestError("messages", "this model defines no chat template; use /v1/completions")
            text = _without_bos_text(tokenizer, tokenizer.render_chat(rendered_messages, add_generation_prompt=True,
                                                                      **(template_kwargs or {})))
        else:
            text = compile_chat_template(FALLBACK_TEMPLATE).render(messages=rendered_messages,
                                                                   add_generation_prompt=True,
                                                                   **(template_kwargs or {}))
    except TokenizerError as exc:
        raise InvalidRequestError("messages", str(exc)) from exc
    segments: list[dict[str, Any]] = []
    rest = text
    for mark, (part_text, where) in cached.items():
        count = text.count(mark)
        if count != 1:
            how = "dropped" if count == 0 else f"repeated ({count} times)"
            raise InvalidRequestError(where, f"the chat template {how} this cacheable part; mark it uncached")
        before, rest = rest.split(mark, 1)
        if before:
            segments.append({"text": before, "cache": False})
        segments.append({"text": part_text, "cache": True})
    if rest:
        segments.append({"text": rest, "cache": False})
    return segments


def _without_bos_text(tokenizer, text: str) -> str:
    """The rendered text without the BOS text a template writes at its front (the engine
    adds the BOS token itself), as `CheckpointTokenizer.chat_prompt` returns it."""
    bos = tokenizer.special_text.get("bos_token")
    if tokenizer.bos_id is not None and bos and text.startswith(bos) and tokenizer.encode(bos) == [tokenizer.bos_id]:
        return text[len(bos):]
    return text


def chat_body(
    completion_id: str,
    model: str,
    text: str,
    finish_reason: Optional[str],
    usage: dict[str, Any],
    timings: Optional[dict[str, Any]] = None,
    created: Optional[int] = None,
) -> dict[str, Any]:
    """A full (non-streamed) chat completion."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage,
    }
    if timings is not None:
        body["timings"] = timings
    return body


def chat_chunk(
    completion_id: str,
    model: str,
    created: int,
    delta: Optional[dict[str, Any]],
    finish_reason: Optional[str] = None,
) -> dict[str, Any]:
    """One stream chunk: `delta` for choice 0 (`{"role": "assistant", "content": ""}`
    first, then `{"content": piece}`, `{}` with the finish reason), or None for the
    usage chunk (no choices)."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}],
    }
    return body

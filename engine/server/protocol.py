"""The OpenAI-style completions wire format: parsing a request body into engine inputs
(with a 400-worthy `InvalidRequestError` naming the field at the first bad value) and
building the JSON of responses and stream chunks.

Accepted body of POST /v1/completions:

| field | type | default | notes |
|---|---|---|---|
| `prompt` | string, or list of token ids | - | exactly one of `prompt` / `segments` |
| `segments` | list of `{"text": str, "cache": bool}` | - | extension: a prompt in pieces, each marked reusable or not |
| `max_tokens` | int >= 1 | 16 | |
| `temperature` | number >= 0 | 1.0 | 0 is greedy |
| `top_p` | number in (0, 1] | 1.0 | |
| `stop` | string or list of strings | none | output is cut before the first stop string |
| `seed` | int | none | per-request sampling seed |
| `stream` | bool | false | server-sent events, ended by `data: [DONE]` |
| `stream_options` | `{"include_usage": bool}` | none | a last chunk with `usage` |
| `n`, `best_of` | 1 only | 1 | |
| `echo`, `logprobs`, `suffix` | false/null only | | not supported: another value is a 400 naming the field |
| `presence_penalty`, `frequency_penalty` | 0/null only | | not supported: another value is a 400 |
| `logit_bias` | empty/null only | | not supported: another value is a 400 |
| `model` | string | the served model | another model's name is a 404 `model_not_found` (the server's app checks it) |
| `user` | string | | accepted and ignored |

Other fields are ignored, as vLLM does. An OpenAI field the engine does not implement is
refused when it asks for a behaviour (a non-default value), never silently ignored.

`error_body` builds every error response (`{"error": {message, type, param, code}}`) and
`usage_body` every `usage` object (with `prompt_tokens_details.cached_tokens`: prompt
tokens filled from a cache), for this route and any later one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from engine.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request."""

    model: Optional[str]
    prompt: Union[str, list[int], None]
    segments: Optional[list[dict[str, Any]]]  # [{"text": str, "cache": bool}, ...]
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: Optional[int]
    stream: bool
    include_usage: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _parse_segments(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("segments", "must be a non-empty list of {text, cache} objects")
    segments = []
    for i, seg in enumerate(raw):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise InvalidRequestError(where, f"must be an object with text and cache, got {type(seg).__name__}")
        text = seg.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.text", f"must be a string, got {type(text).__name__}")
        cache = seg.get("cache", False)
        if not isinstance(cache, bool):
            raise InvalidRequestError(f"{where}.cache", f"must be true or false, got {cache!r}")
        unknown = set(seg) - {"text", "cache"}
        if unknown:
            raise InvalidRequestError(f"{where}.{sorted(unknown)[0]}", "unknown segment field (allowed: text, cache)")
        segments.append({"text": text, "cache": cache})
    if not any(s["text"] for s in segments):
        raise InvalidRequestError("segments", "all segments are empty")
    return segments


def _parse_prompt(raw: Any) -> Union[str, list[int]]:
    if isinstance(raw, str):
        if not raw:
            raise InvalidRequestError("prompt", "must not be empty")
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        return list(raw)
    if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        if len(raw) == 1:
            return _parse_prompt(raw[0])
        raise InvalidRequestError("prompt", f"batches of prompts are not supported (got {len(raw)}); send one request per prompt")
    raise InvalidRequestError("prompt", "must be a non-empty string or a non-empty list of token ids")


@dataclass(frozen=True)
class SamplingFields:
    """The body fields shared by /v1/completions and /v1/chat/completions: how to sample
    and how to answer. `max_tokens` None: the route's own default applies."""

    model: Optional[str]
    max_tokens: Optional[int]
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: Optional[int]
    stream: bool
    include_usage: bool


def parse_sampling_fields(body: dict[str, Any], max_tokens_field: str = "max_tokens") -> SamplingFields:
    """Validate the fields every generation route shares (see the table above; `n`, the
    penalties and `logit_bias` only at their defaults); raise `InvalidRequestError`
    naming the bad field. `max_tokens_field` names where `max_tokens` was read (the chat
    route also takes `max_completion_tokens`)."""
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise InvalidRequestError(max_tokens_field, f"must be an integer >= 1, got {max_tokens!r}")

    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature) or temperature < 0:
        raise InvalidRequestError("temperature", f"must be a number >= 0, got {temperature!r}")

    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequestError("top_p", f"must be a number in (0, 1], got {top_p!r}")

    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        stops = tuple(s for s in stop if s)
    else:
        raise InvalidRequestError("stop", f"must be a string or a list of strings, got {stop!r}")

    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise InvalidRequestError("seed", f"must be an integer, got {seed!r}")

    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream", f"must be true or false, got {stream!r}")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise InvalidRequestError("stream_options", 'must be {"include_usage": true|false}')
        include_usage = opts.get("include_usage", False)

    value = body.get("n")
    if value is not None and value != 1:
        raise InvalidRequestError("n", f"only 1 is supported, got {value!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or value != 0):
            raise InvalidRequestError(name, f"is not supported (only 0), got {value!r}")
    if body.get("logit_bias") not in (None, {}):
        raise InvalidRequestError("logit_bias", "is not supported (only an empty object)")
    for name in ("model", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequestError(name, f"must be a string, got {body[name]!r}")
    return SamplingFields(model=body.get("model"), max_tokens=max_tokens, temperature=float(temperature),
                          top_p=float(top_p), stop=stops, seed=seed, stream=stream, include_usage=include_usage)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body; raise `InvalidRequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    has_prompt = body.get("prompt") is not None
    has_segments = body.get("segments") is not None
    if has_prompt == has_segments:
        raise InvalidRequestError("prompt", "give exactly one of prompt or segments")
    prompt = _parse_prompt(body["prompt"]) if has_prompt else None
    segments = _parse_segments(body["segments"]) if has_segments else None
    fields = parse_sampling_fields(body)

    value = body.get("best_of")
    if value is not None and value != 1:
        raise InvalidRequestError("best_of", f"only 1 is supported, got {value!r}")
    if body.get("echo") not in (None, False):
        raise InvalidRequestError("echo", "is not supported")
    for name in ("logprobs", "suffix"):
        if body.get(name) is not None:
            raise InvalidRequestError(name, "is not supported")

    return CompletionRequest(
        model=fields.model,
        prompt=prompt,
        segments=segments,
        max_tokens=DEFAULT_MAX_TOKENS if fields.max_tokens is None else fields.max_tokens,
        temperature=fields.temperature,
        top_p=fields.top_p,
        stop=fields.stop,
        seed=fields.seed,
        stream=fields.stream,
        include_usage=fields.include_usage,
    )


def error_body(message: str, field: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict[str, Any]:
    """OpenAI-style error JSON; `param` names the offending field, `code` the error
    (e.g. "model_not_found", "not_found", "method_not_allowed")."""
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def model_error(requested: str, served: str) -> dict[str, Any]:
    """The 404 body for a `model` this server does not serve."""
    return error_body(f"The model `{requested}` does not exist; this server serves `{served}`", "model",
                      "invalid_request_error", "model_not_found")


def completion_body(
    completion_id: str,
    model: str,
    text: str,
    finish_reason: Optional[str],
    usage: Optional[dict[str, int]] = None,
    timings: Optional[dict[str, Any]] = None,
    created: Optional[int] = None,
) -> dict[str, Any]:
    """A full response, or (with `usage` None) one stream chunk."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    if timings is not None:
        body["timings"] = timings
    return body


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI `usage`; `cached_tokens`: prompt tokens filled from a cache (reused) rather
    than computed for this request."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

"""Parsing of /v1/completions bodies: defaults, the segments extension, and 400-worthy
errors that name the offending field."""
import pytest

from engine.errors import InvalidRequestError
from engine.server.protocol import parse_completion_request


def test_prompt_request_gets_openai_defaults():
    req = parse_completion_request({"prompt": "hello", "model": "x"})
    assert req.prompt == "hello" and req.segments is None
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed, req.stream) == (16, 1.0, 1.0, (), None, False)


def test_segments_extension_keeps_text_and_cache_flags_in_order():
    req = parse_completion_request(
        {"segments": [{"text": "doc", "cache": True}, {"text": "q?"}], "max_tokens": 3, "stop": "\n", "seed": 7}
    )
    assert req.prompt is None
    assert req.segments == [{"text": "doc", "cache": True}, {"text": "q?", "cache": False}]
    assert (req.max_tokens, req.stop, req.seed) == (3, ("\n",), 7)


def test_token_id_prompt_and_single_string_list_are_accepted():
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion_request({"prompt": ["abc"]}).prompt == "abc"


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "body"),
        ({}, "prompt"),
        ({"prompt": "a", "segments": [{"text": "b"}]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"segments": []}, "segments"),
        ({"segments": ["text"]}, "segments[0]"),
        ({"segments": [{"text": "a"}, {"text": 5}]}, "segments[1].text"),
        ({"segments": [{"text": "a", "cache": "yes"}]}, "segments[0].cache"),
        ({"segments": [{"text": "a", "cahce": True}]}, "segments[0].cahce"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "stop": 3}, "stop"),
        ({"prompt": "a", "seed": "x"}, "seed"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "logprobs": 2}, "logprobs"),
        ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options"),
        # unsupported OpenAI fields asking for a behaviour are refused, like echo / logprobs / n
        ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "a", "frequency_penalty": -1}, "frequency_penalty"),
        ({"prompt": "a", "logit_bias": {"50256": -100}}, "logit_bias"),
        ({"prompt": "a", "suffix": "tail"}, "suffix"),
        ({"prompt": "a", "echo": True}, "echo"),
    ],
)
def test_bad_field_is_named_in_the_error(body, field):
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request(body)
    assert info.value.field == field
    assert field in str(info.value)


def test_unsupported_fields_at_their_defaults_are_accepted():
    req = parse_completion_request({"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0,
                                    "logit_bias": {}, "suffix": None, "echo": False, "n": 1, "model": "m"})
    assert req.prompt == "a" and req.model == "m"


def test_usage_reports_cached_prompt_tokens_and_errors_carry_a_code():
    from engine.server.protocol import error_body, model_error, usage_body

    assert usage_body(10, 3, 6) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                    "prompt_tokens_details": {"cached_tokens": 6}}
    assert error_body("m", "f", "t", "c") == {"error": {"message": "m", "type": "t", "param": "f", "code": "c"}}
    err = model_error("gpt-4", "ring-tiny")["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]

"""Chat completions bodies (engine.server.chat): parsing with 400-worthy errors naming the
field, and the rendering rule (template text and uncached parts become uncached
segments; each cacheable part stays one whole cached segment, verbatim), on the presets'
fallback template."""
import pytest

from engine.errors import InvalidRequestError
from engine.server.chat import ChatMessage, ChatPart, parse_chat_request, render_segments
from engine.tokenizer import ByteTokenizer


def test_string_and_part_contents_parse_with_cache_flags():
    req = parse_chat_request({"messages": [
        {"role": "system", "content": "be brief", "cache": True},
        {"role": "user", "content": [{"type": "text", "text": "doc", "cache": True}, {"type": "text", "text": "q?"}]},
    ], "max_completion_tokens": 5, "temperature": 0})
    assert req.messages == (
        ChatMessage("system", (ChatPart("be brief", True),)),
        ChatMessage("user", (ChatPart("doc", True), ChatPart("q?", False))),
    )
    assert (req.sampling.max_tokens, req.sampling.temperature) == (5, 0.0)
    assert req.max_tokens_field == "max_completion_tokens"
    assert parse_chat_request({"messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "body"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a", "cache": "yes"}]}, "messages[0].cache"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}], "cache": True}]},
         "messages[0].cache"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
         "messages[0].content[0].cache"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": "many"}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "max_completion_tokens": 2}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "a"}], "n": 3}, "n"),
        ({"messages": [{"role": "user", "content": "a"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}},
         "chat_template_kwargs.messages"),
    ],
)
def test_bad_chat_body_is_refused_naming_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_chat_request(body)
    assert err.value.field == field


def test_fallback_template_cuts_the_rendered_text_at_each_cacheable_part():
    req = parse_chat_request({"messages": [
        {"role": "system", "content": " sys prompt ", "cache": True},
        {"role": "user", "content": [{"type": "text", "text": "DOC A", "cache": True},
                                     {"type": "text", "text": "\nDOC B\n", "cache": True},
                                     {"type": "text", "text": "Q?"}]},
    ]})
    assert render_segments(ByteTokenizer(), req.messages) == [
        {"text": "system: ", "cache": False},
        {"text": " sys prompt ", "cache": True},  # verbatim, whitespace kept
        {"text": "\nuser: ", "cache": False},
        {"text": "DOC A", "cache": True},
        {"text": "\nDOC B\n", "cache": True},  # adjacent parts: no empty segment between them
        {"text": "Q?\nassistant: ", "cache": False},
    ]


def test_without_cacheable_parts_the_conversation_is_one_uncached_segment():
    req = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]})
    assert render_segments(ByteTokenizer(), req.messages) == [{"text": "user: ab\nassistant: ", "cache": False}]


def test_an_empty_served_model_name_is_refused_before_loading_anything():
    from typer.testing import CliRunner

    from engine.cli import app

    res = CliRunner().invoke(app, ["serve", "--preset", "qwen3next-tiny", "--served-model-name", " "])
    assert res.exit_code == 2 and "--served-model-name: must not be empty" in res.stderr

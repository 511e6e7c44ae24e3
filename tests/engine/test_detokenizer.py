"""Incremental output text: multi-byte characters split across byte tokens, stop
strings spanning tokens, and streamed deltas that never show a stop string."""
from engine.runtime.detokenizer import OutputText
from engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def feed(text_obj, s, one_by_one=True):
    ids = TOK.encode(s)
    deltas = []
    for t in ids:
        stopped = text_obj.append([t])
        deltas.append(text_obj.take_delta())
        if stopped:
            break
    deltas.append(text_obj.flush())
    return deltas


def test_multibyte_characters_are_emitted_whole():
    out = OutputText(TOK)
    deltas = feed(out, "añ€😀b")
    assert "".join(deltas) == "añ€😀b" == out.text
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas  # the four bytes of the emoji come out as one piece


def test_stop_string_across_tokens_cuts_the_text_before_it():
    out = OutputText(TOK, stop=["END", "\n\n"])
    deltas = feed(out, "hello ENDING more")
    assert out.text == "hello " and out.stopped_on == "END"
    assert "".join(deltas) == "hello "


def test_stream_holds_back_only_possible_stop_prefixes():
    out = OutputText(TOK, stop=["STOP"])
    out.append(TOK.encode("abc ST"))
    assert out.take_delta() == "abc "  # "ST" might begin "STOP"
    out.append(TOK.encode("AR"))
    assert out.take_delta() == "STAR"  # it did not
    assert out.flush() == "" and out.text == "abc STAR"


def test_special_and_out_of_vocabulary_ids_add_no_text():
    out = OutputText(TOK)
    out.append([ord("x"), TOK.EOS, 5000, ord("y")])
    assert out.take_delta() + out.flush() == "xy"


def test_dangling_partial_character_is_flushed_as_replacement():
    out = OutputText(TOK)
    out.append([0xE2, 0x82])  # first two bytes of the euro sign
    assert out.take_delta() == ""
    assert out.flush() == "\ufffd"

"""Incremental detokenization: multi-byte characters and stop strings."""

from scheduler.detokenizer import Detokenizer
from tests.tiny_models import make_tokenizer

TOK = make_tokenizer()


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def _feed(d: Detokenizer, ids: list[int]) -> tuple[str, bool]:
    out = ""
    for t in ids:
        delta, hit = d.add([t])
        out += delta
        if hit:
            return out, True
    return out + d.flush(), False


def test_round_trip_one_token_at_a_time_with_multibyte_chars():
    text = "naïve café — ok ✓"
    ids = _ids(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    d = Detokenizer(TOK, [])
    deltas = [d.add([t])[0] for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_cuts_and_is_never_streamed():
    d = Detokenizer(TOK, ["STOP"])
    out, hit = _feed(d, _ids("hello STOP world"))
    assert hit and out == "hello "


def test_partial_stop_string_is_held_back_then_released():
    d = Detokenizer(TOK, ["<END>"])
    streamed = [d.add([t])[0] for t in _ids("a <EN")]
    assert "".join(streamed) == "a"  # "<EN" might still become "<END>"
    assert d.flush() == " <EN"


def test_earliest_of_several_stop_strings_wins():
    d = Detokenizer(TOK, ["world", "lo w"])
    out, hit = _feed(d, _ids("hello world"))
    assert hit and out == "hel"

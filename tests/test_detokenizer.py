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


def test_native_stream_and_window_give_the_same_deltas():
    """The tokenizers library's DecodeStream (one Rust call per token) and the window of
    two decodes give the same deltas, token by token: random byte tokens (broken UTF-8
    included), special tokens, ids past the vocabulary, and text with a stop string."""
    import random

    assert Detokenizer(TOK, [])._stream is not None, "the test tokenizer takes the native path"
    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(TOK.vocab_size + 3) for _ in range(200)]
        ids[::17] = _ids("naïve café — ok ✓ STOP")[: len(ids[::17])]
        stop = ["STOP"] if trial % 2 else []
        stream, window = Detokenizer(TOK, stop), Detokenizer(TOK, stop)
        window._stream = None
        for t in ids:
            a, b = stream.add([t]), window.add([t])
            assert a == b
            if a[1]:
                break
        assert stream.flush() == window.flush()


def test_no_stop_string_matches_before_it_may():
    """min_tokens (vLLM's rule): text fed with stops=False is emitted whole and never
    stops the request; a stop string must end after it."""
    d = Detokenizer(TOK, ["ab"])
    early = "".join(d.add([t], stops=False)[0] for t in _ids("x ab a"))
    assert early == "x ab a"  # streamed whole: nothing held back for a stop string
    out, hit = _feed(d, _ids("b c ab"))  # "a" + "b" completes one across the floor
    assert hit and out == ""
    d = Detokenizer(TOK, ["ab"])
    early = "".join(d.add([t], stops=False)[0] for t in _ids("x ab"))
    out, hit = _feed(d, _ids(" c ab d"))
    assert hit and out == " c "


def test_include_stop_keeps_the_matched_stop_string():
    d = Detokenizer(TOK, ["world", "lo w"], include_stop=True)
    out, hit = _feed(d, _ids("hello world"))
    assert hit and out == "hello w"  # the earliest match, kept whole


def test_special_tokens_text_when_not_skipped():
    ids = _ids("a") + TOK.convert_tokens_to_ids(["<|im_end|>"]) + _ids("b")
    for native in (True, False):
        kept, skipped = Detokenizer(TOK, [], skip_special_tokens=False), Detokenizer(TOK, [])
        if not native:
            kept._stream = skipped._stream = None
        assert _feed(kept, ids) == ("a<|im_end|>b", False)
        assert _feed(skipped, ids) == ("ab", False)

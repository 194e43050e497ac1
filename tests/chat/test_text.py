"""Incremental detokenizer and stop strings (runtime/decoding/text.py)."""


from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from fake_backend import make_tokenizer  # noqa: E402

from decodert.runtime.decoding.text import IncrementalDetokenizer, StopMatcher  # noqa: E402

TEXT = "héllo 😀 wörld, the quick 🦊 fox"


def _stream(detok, ids):
    return [detok.push(t) for t in ids] + [detok.flush()]


def test_byte_tokens_of_one_emoji_stream_as_one_delta():
    tok = make_tokenizer()
    ids = tok.encode(TEXT).ids
    emoji_ids = tok.encode("😀").ids
    assert len(emoji_ids) == 4, "the test needs the emoji split into byte tokens"
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas and "🦊" in deltas  # each emoji arrives whole, alone
    assert deltas.count("") >= 6  # 3 held-back byte tokens per emoji


def test_context_tokens_are_not_emitted():
    tok = make_tokenizer()
    prompt, gen = tok.encode("hello world").ids, tok.encode(" the quick fox").ids
    deltas = _stream(IncrementalDetokenizer(tok, prompt), gen)
    assert "".join(deltas) == " the quick fox"


def _metaspace_tokenizer():
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_leading_space_kept_with_prompt_context():
    tok = _metaspace_tokenizer()
    assert tok.decode([2]) == "world"  # alone, SentencePiece drops the leading space
    deltas = _stream(IncrementalDetokenizer(tok, [1]), [2, 3, 4])
    assert "".join(deltas) == " world! again"
    assert deltas[:3] == [" world", "!", " again"]


def test_flush_drops_an_incomplete_character():
    tok = make_tokenizer()
    ids = tok.encode("a😀").ids
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(t) for t in ids[:3]] == ["a", "", ""]
    assert detok.flush() == ""
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[1]) == ""  # a lone lead byte: held
    assert detok.push(ids[0]) == "\ufffda"  # then "a": an invalid byte inside the text stays visible


def test_invalid_bytes_are_not_held_forever():
    tok = make_tokenizer()
    cont = tok.encode("😀").ids[1]  # a UTF-8 continuation byte: never completes a character
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(cont) for _ in range(30)]
    assert any(deltas) and "".join(deltas).count("\ufffd") >= 20


def test_stop_string_across_deltas():
    m = StopMatcher(["STOP"])
    assert m.push("hello S") == ("hello ", False)  # "S" held: could start STOP
    assert m.push("T") == ("", False)
    assert m.push("OP and more") == ("", True)
    assert m.push("x") == ("", True) and m.flush() == ""


def test_held_text_released_when_not_a_stop():
    m = StopMatcher(["STOP"])
    assert m.push("a ST") == ("a ", False)
    assert m.push("ay") == ("STay", False)
    assert m.push("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True) and m.matched == "lo w"
    m = StopMatcher(["lo", "lo w", "xyz"])  # two at the same place: the longer is the one that matched
    assert m.push("hel") == ("he", False) and m.push("lo world") == ("l", True) and m.matched == "lo w"
    assert StopMatcher(["x"]).matched is None


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False) and m.flush() == ""


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abST OP", max_size=30), st.lists(st.integers(0, 30), max_size=6),
       st.lists(st.sampled_from(["STOP", "OP a", "b", "TS", "aaa"]), min_size=1, max_size=3))
def test_stop_matching_is_split_invariant(text, cuts, stops):
    pieces, last = [], 0
    for c in sorted(cuts):
        pieces.append(text[last:c])
        last = max(last, c)
    pieces.append(text[last:])
    m = StopMatcher(stops)
    out, stopped = "", False
    for p in pieces:
        safe, stopped = m.push(p)
        out += safe
        assert not any(s in out for s in stops)
    out += m.flush()
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert out == expected and stopped == bool(hits)

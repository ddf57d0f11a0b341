"""IncrementalDetokenizer with the tiny checkpoints' real byte-level BPE tokenizer.

Output tokens are fed the way ``OutputProcessor.process`` feeds them (one at a time,
``finished=True`` on the last one, then ``flush()``) and the streamed text is compared
with a full ``tokenizer.decode`` of the same ids.
"""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from nvllm.leader.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, fast_decoder

FFFD = "\ufffd"
EOS, IM_START, IM_END = 0, 1, 2

ENGLISH = "Hello world, the quick brown fox jumps over the lazy dog. The sun is a star."
MULTIBYTE = [
    "日本語のテキスト、そして中文字符。",
    "Party time 😀🎉 with 👩‍💻 and 🇫🇷 flags",
    "café naïve résumé über Ångström ñandú",
    "mixed: 한국어 text, Ελληνικά, русский, and a snowman ☃!",
]


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny("qwen3"))


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def stream(tok, prompt_ids: list[int], out_ids: list[int], **kw):
    """Feed out_ids one at a time like the engine; returns (deltas, hit index, detok).

    Stops feeding at the first stop-string hit (the engine ends the sequence there). The
    last element of deltas is what flush() returned.
    """
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas, hit_at = [], None
    for i, t in enumerate(out_ids):
        delta, hit = d.add([t], finished=i == len(out_ids) - 1)
        deltas.append(delta)
        if hit:
            hit_at = i
            break
    deltas.append(d.flush())
    return deltas, hit_at, d


def cut_at_stop(text: str, stops: list[str], include: bool = False) -> str:
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return text
    i, s = min(found)
    return text[:i + len(s)] if include else text[:i]


# ---- plain streaming ----------------------------------------------------------------------


def test_english_streams_to_the_full_decode(tok):
    ids = enc(tok, ENGLISH)
    deltas, hit, d = stream(tok, [], ids)
    assert hit is None
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == ENGLISH
    assert d.text == ENGLISH
    # No stop strings: nothing is held back, every token's text comes out at once.
    assert deltas[-1] == "" and all(deltas[:-1])


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_split_across_tokens(tok, text):
    ids = enc(tok, text)
    # The text really exercises splitting: some single tokens are partial characters.
    assert any(tok.decode([t]).endswith(FFFD) for t in ids)
    assert FFFD not in tok.decode(ids)
    deltas, _, d = stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any(FFFD in x for x in deltas), "a delta showed a partial character"
    assert d.text == text


def test_multibyte_after_a_multibyte_prompt(tok):
    prompt = enc(tok, "Réponds en japonais: 日本")
    ids = enc(tok, "語のテキスト 😀 ok")
    deltas, _, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) and not any(FFFD in x for x in deltas)


def test_random_mixed_text_round_trips(tok):
    rng = random.Random(0)
    pieces = ["the", " quick", " 日本", "語", " é", "ü", " 😀", "🎉", ".", "\n", " ok", "Ω"]
    for _ in range(30):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        prompt = enc(tok, "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))))
        ids = enc(tok, text)
        deltas, _, _ = stream(tok, prompt, ids)
        assert "".join(deltas) == text
        assert not any(FFFD in x for x in deltas)


def test_incomplete_character_is_held_until_it_completes(tok):
    ids = enc(tok, "é")
    assert len(ids) == 2 and tok.decode(ids[:1]) == FFFD
    d = IncrementalDetokenizer(tok, enc(tok, "The"))
    assert d.add(ids[:1]) == ("", False)
    assert d.add(ids[1:]) == ("é", False)


def test_several_tokens_in_one_add(tok):
    ids = enc(tok, "naïve 😀 fox")
    d = IncrementalDetokenizer(tok, [])
    got = [d.add(ids[i:i + 3])[0] for i in range(0, len(ids), 3)] + [d.flush()]
    assert "".join(got) == "naïve 😀 fox"
    assert not any(FFFD in x for x in got)


def test_finished_add_with_a_character_split_inside_the_batch(tok):
    ids = enc(tok, "é")
    d = IncrementalDetokenizer(tok, [])
    delta, _ = d.add(ids, finished=True)
    assert delta + d.flush() == "é"


def test_truncated_character_is_flushed_on_finish(tok):
    """A completion that ends inside a character shows what decode shows (U+FFFD)."""
    ids = enc(tok, "ok é")[:-1]
    deltas, _, _ = stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids) == "ok " + FFFD


def test_ids_without_a_token_decode_to_nothing(tok):
    """Model ids >= len(tokenizer) exist in a random model and contribute no text."""
    ids = enc(tok, "the fox")
    out = ids[:1] + [len(tok) + 3] + ids[1:]
    deltas, _, _ = stream(tok, [], out)
    assert "".join(deltas) == tok.decode(out) == "the fox"


def test_without_a_tokenizer_nothing_is_decoded():
    d = IncrementalDetokenizer(None, [1, 2, 3], stop=["x"])
    assert d.add([5, 6], finished=True) == ("", False)
    assert d.flush() == ""


# ---- special tokens -----------------------------------------------------------------------


def test_special_tokens_skipped_by_default(tok):
    ids = enc(tok, "hi there") + [IM_END] + enc(tok, " bye")
    deltas, _, _ = stream(tok, [IM_START], ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "hi there bye"


def test_special_tokens_kept_when_asked(tok):
    ids = enc(tok, "hi there") + [IM_END] + enc(tok, "\n")
    deltas, _, _ = stream(tok, [IM_START], ids, skip_special_tokens=False)
    text = "".join(deltas)
    assert text == tok.decode(ids, skip_special_tokens=False) == "hi there<|im_end|>\n"


# ---- prompt context -----------------------------------------------------------------------


@pytest.mark.parametrize("prompt_text,out_text", [
    ("The quick brown", " fox jumps over the lazy dog"),
    ("Question: What is two plus three? Answer:", " Two plus three is five."),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "Hello world"),
    ("A", " b"),
])
def test_first_output_word_is_spaced_like_a_full_decode(tok, prompt_text, out_text):
    prompt = tok(prompt_text, add_special_tokens=False).input_ids
    out = enc(tok, out_text)
    assert len(prompt) >= 1
    full = tok.decode(prompt + out, skip_special_tokens=True)
    want = full[len(tok.decode(prompt, skip_special_tokens=True)):]
    deltas, _, _ = stream(tok, prompt, out)
    assert deltas[0] == tok.decode(prompt + out[:1], skip_special_tokens=True)[
        len(tok.decode(prompt, skip_special_tokens=True)):]
    assert "".join(deltas) == want == out_text


def test_only_the_last_prompt_tokens_are_context(tok):
    prompt = enc(tok, "The sun is a star. The moon reflects the light")
    assert len(prompt) > CONTEXT_TOKENS
    d = IncrementalDetokenizer(tok, prompt)
    assert d.ids == prompt[-CONTEXT_TOKENS:]


# ---- stop strings -------------------------------------------------------------------------


def check_stop_stream(tok, prompt, ids, stops, include=False):
    """Common checks; returns (deltas, hit index)."""
    full = tok.decode(ids, skip_special_tokens=True)
    want = cut_at_stop(full, stops, include)
    deltas, hit_at, d = stream(tok, prompt, ids, stop=stops,
                               include_stop_str_in_output=include)
    assert "".join(deltas) == want == d.text
    if hit_at is not None:
        before = "".join(deltas[:hit_at])  # everything streamed before the hit
        assert not any(s in before for s in stops)
        # The hit is reported on the token that completes the first stop string.
        assert cut_at_stop(tok.decode(ids[:hit_at], skip_special_tokens=True), stops) == \
            tok.decode(ids[:hit_at], skip_special_tokens=True)
        assert cut_at_stop(tok.decode(ids[:hit_at + 1], skip_special_tokens=True), stops) != \
            tok.decode(ids[:hit_at + 1], skip_special_tokens=True)
    return deltas, hit_at


def test_text_ends_right_before_the_stop_string(tok):
    ids = enc(tok, ENGLISH)
    deltas, hit_at = check_stop_stream(tok, [], ids, [" quick"])
    assert "".join(deltas) == "Hello world, the"
    assert hit_at == ids.index(enc(tok, " quick")[0])


def test_stop_string_included_when_asked(tok):
    ids = enc(tok, ENGLISH)
    deltas, hit_at = check_stop_stream(tok, [], ids, [" quick"], include=True)
    assert "".join(deltas) == "Hello world, the quick"


def test_stop_string_spanning_several_tokens(tok):
    ids = enc(tok, "Hello world, the quick fox.")
    # "lo wor" spans 'ell' / 'o' / ' wor'; "rld, th" spans ' wor' / 'ld' / ',' / ' the'.
    for stop, want in (("lo wor", "Hel"), ("rld, th", "Hello wo"), ("world", "Hello ")):
        deltas, hit_at = check_stop_stream(tok, [], ids, [stop])
        assert "".join(deltas) == want
        assert hit_at is not None
        for include in (True, False):
            check_stop_stream(tok, [], ids, [stop], include=include)


def test_every_stop_position_in_a_text(tok):
    """For every substring stop of a few lengths: deltas never show it, text cut at it."""
    text = "The quick fox, 日本語 and é: done."
    ids = enc(tok, text)
    for length in (1, 2, 3, 5):
        for i in range(len(text) - length + 1):
            stop = text[i:i + length]
            for include in (False, True):
                check_stop_stream(tok, enc(tok, "Say:"), ids, [stop], include=include)


def test_earliest_of_several_stop_strings_wins(tok):
    ids = enc(tok, ENGLISH)
    deltas, _ = check_stop_stream(tok, [], ids, ["lazy", "fox", "quick brown"])
    assert "".join(deltas) == "Hello world, the "
    # A long stop string found in the same token as a short one that starts later.
    deltas, _ = check_stop_stream(tok, [], ids, ["k", "quick"])
    assert "".join(deltas) == "Hello world, the "


def test_stop_string_in_the_prompt_does_not_stop(tok):
    prompt = enc(tok, "Say STOP and then the quick fox")
    ids = enc(tok, " jumps over the lazy dog")
    deltas, hit_at, _ = stream(tok, prompt, ids, stop=["STOP", "quick fox"])
    assert hit_at is None
    assert "".join(deltas) == " jumps over the lazy dog"


def test_holdback_then_release_on_finish(tok):
    ids = enc(tok, "Hello world, the")
    d = IncrementalDetokenizer(tok, [], stop=["the end"])
    streamed = ""
    for t in ids[:-1]:
        delta, hit = d.add([t])
        assert not hit
        streamed += delta
    # At most len("the end") - 1 characters are held back while generating.
    assert streamed == d.text[:max(0, len(d.text) - len("the end") + 1)]
    assert len(streamed) < len(d.text)
    delta, hit = d.add(ids[-1:], finished=True)
    assert not hit
    assert streamed + delta == "Hello world, the"
    assert d.flush() == ""


def test_held_back_tail_is_released_by_flush(tok):
    ids = enc(tok, "Hello world, the")
    d = IncrementalDetokenizer(tok, [], stop=["the end"])
    streamed = "".join(d.add([t])[0] for t in ids)
    assert streamed != "Hello world, the"
    assert streamed + d.flush() == "Hello world, the"
    assert d.flush() == ""


def test_partial_match_that_does_not_complete_is_released(tok):
    ids = enc(tok, "the quick fox and the lazy dog")
    deltas, hit_at, _ = stream(tok, [], ids, stop=["the slow"])
    assert hit_at is None
    assert "".join(deltas) == "the quick fox and the lazy dog"


def test_stop_string_with_multibyte_characters(tok):
    ids = enc(tok, "Party 😀🎉 time, café time")
    deltas, hit_at = check_stop_stream(tok, [], ids, ["🎉 t"])
    assert "".join(deltas) == "Party 😀"
    deltas, hit_at = check_stop_stream(tok, [], ids, ["é"], include=True)
    assert "".join(deltas) == "Party 😀🎉 time, café"
    assert not any(FFFD in x for x in deltas)


def test_stop_string_found_on_the_finishing_token(tok):
    ids = enc(tok, "Hello world")
    d = IncrementalDetokenizer(tok, [], stop=["world"])
    out = "".join(d.add([t])[0] for t in ids[:-1])
    delta, hit = d.add(ids[-1:], finished=True)
    assert hit
    assert out + delta + d.flush() == "Hello "


# ---- the backend's decode ------------------------------------------------------------------


def wrapper_decode(tok):
    """The reference: the transformers tokenizer's own decode."""
    return lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)


def test_the_fast_decoder_is_the_tokenizers_decode(tok):
    fast = fast_decoder(tok)
    calls = []
    tok_decode = tok.decode
    tok.decode = lambda *a, **k: calls.append(1) or tok_decode(*a, **k)
    try:
        fast([5, 6], True)
    finally:
        del tok.decode
    assert calls == []  # the backend path is the one taken
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tok) + 5) for _ in range(rng.randint(0, 9))]
        for skip in (True, False):
            assert fast(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode():
    class Cleans:
        clean_up_tokenization_spaces = True
        backend_tokenizer = None

        def decode(self, ids, skip_special_tokens):
            return f"wrapped {ids} {skip_special_tokens}"

    assert fast_decoder(Cleans())([1, 2], True) == "wrapped [1, 2] True"


def test_a_tokenizer_with_its_own_decode_keeps_it(tok):
    own = type("OwnDecode", (type(tok),), {"_decode": lambda self, *a, **k: "own"})
    t = copy.copy(tok)
    t.__class__ = own
    assert fast_decoder(t)([5, 6], True) == "own"


def test_fast_decoding_streams_what_the_wrapper_streams(tok):
    """Completions with stop strings, multi-byte characters and both special-token
    settings stream exactly the deltas they stream with the wrapper's decode."""
    rng = random.Random(2)
    pieces = ["the", " quick", " 日本", "語", " é", "ü", " 😀", "🎉", ".", "\n", " ok", "Ω",
              " stop", "<|im_end|>"]
    for _ in range(40):
        out = enc(tok, "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))))
        prompt = enc(tok, "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))))
        kw = dict(stop=rng.choice([None, [" stop"], ["語 ", "\n"], ["😀🎉"]]),
                  include_stop_str_in_output=rng.random() < 0.5,
                  skip_special_tokens=rng.random() < 0.7)
        fast = stream(tok, prompt, out, **kw)
        slow = stream(tok, prompt, out, **kw, decode=wrapper_decode(tok))
        assert fast[:2] == slow[:2] and fast[2].text == slow[2].text

"""Stop conditions on their own: the bundled tokenizer (no weights), tokens fed one at a time."""

import pytest

from backend_engine.sequence import SamplingParams, Sequence
from backend_engine.stop import apply_stop_conditions, find_stop_string, held_back_chars

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok():
    from backend_engine.config import default_model_path
    from backend_engine.model import load_prompt_renderer

    return load_prompt_renderer(default_model_path()).tokenizer


def _generate(tok, token_ids, params, max_model_len=2048):
    """Append tokens until a stop condition holds; the sequence and its finish reason (None: still running)."""
    seq = Sequence(0, "r", PROMPT, params)
    seq.detokenizer = tok.detokenizer(params.skip_special_tokens)
    for t in token_ids:
        seq.token_ids.append(t)
        reason = apply_stop_conditions(seq, t, tok.eos_ids, max_model_len)
        if reason is not None:
            return seq, reason
    return seq, None


def test_stop_string_across_tokens_cuts_the_text_where_it_starts(tok):
    ids = tok.encode("Hello world. Bye now")
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=50, stop=["d. B"]))
    assert reason == "stop" and seq.stop_reason == "d. B"
    assert seq.output_text == "Hello worl"
    assert seq.num_output_tokens < len(ids)  # stopped before the last tokens


def test_included_stop_string_ends_the_text(tok):
    seq, _ = _generate(
        tok, tok.encode("Hello world. Bye now"), SamplingParams(stop=["d. B"], include_stop_str_in_output=True)
    )
    assert seq.output_text == "Hello world. B"


def test_end_of_sequence_stops_without_text_unless_ignored(tok):
    eos = min(tok.eos_ids)
    ids = tok.encode("Yes") + [eos] + tok.encode(" and more")
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=50))
    assert reason == "stop" and seq.stop_reason is None and seq.output_text == "Yes"
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=50, ignore_eos=True))
    assert reason is None and seq.output_text.endswith(" and more")


def test_stop_token_id_is_the_stop_reason(tok):
    ids = tok.encode("one two three")
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=50, stop_token_ids=[ids[1]]))
    assert reason == "stop" and seq.stop_reason == ids[1]
    assert seq.output_token_ids == ids[:2] and seq.output_text == tok.decode(ids[:1])


def test_length_limits(tok):
    ids = tok.encode("one two three four five six")
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=3))
    assert reason == "length" and seq.num_output_tokens == 3 and seq.stop_reason is None
    seq, reason = _generate(tok, ids, SamplingParams(max_tokens=50), max_model_len=len(PROMPT) + 2)
    assert reason == "length" and seq.num_output_tokens == 2


def test_a_dangling_partial_character_is_flushed_on_finish(tok):
    ids = tok.encode("é")
    assert len(ids) == 1 and len(tok.token_bytes[ids[0]]) == 2
    # one byte of a two-byte character: find a token that is exactly the lead byte, if the vocabulary has one
    lead = next((i for i, b in enumerate(tok.token_bytes) if b == tok.token_bytes[ids[0]][:1]), None)
    if lead is None:
        pytest.skip("no single-lead-byte token in this vocabulary")
    seq, reason = _generate(tok, [lead], SamplingParams(max_tokens=1))
    assert reason == "length" and seq.output_text == "\ufffd"


def test_find_stop_string_takes_the_earliest_match_in_new_text():
    assert find_stop_string("abcXYdef", 0, ["def", "XY"]) == (3, "XY")
    assert find_stop_string("XY then", 4, ["XY"]) is None  # ended before the new text
    assert find_stop_string("aXY", 2, ["XY"]) == (1, "XY")  # straddles old and new text
    assert find_stop_string("abc", 0, [""]) is None


def test_held_back_chars_covers_the_longest_stop_string_but_one():
    assert held_back_chars(SamplingParams()) == 0
    assert held_back_chars(SamplingParams(stop=["ab", "wxyz"])) == 3

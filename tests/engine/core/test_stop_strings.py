"""Stop strings over streamed text: matches across deltas, held-back text, and what is finally emitted."""

from __future__ import annotations

import pytest

from tandem.engine.core.stop_strings import StopCheck, StopStringMatcher


def _stream(stops, deltas) -> tuple[list[str], bool, str]:
    """Feeds deltas until a stop; returns what each feed emitted, whether it stopped, and the flushed rest."""
    matcher = StopStringMatcher(stops)
    emitted = []
    for delta in deltas:
        check = matcher.feed(delta)
        emitted.append(check.text)
        if check.stopped:
            return emitted, True, matcher.flush()
    return emitted, False, matcher.flush()


def test_no_stop_strings_pass_every_delta_through():
    matcher = StopStringMatcher([])
    assert [matcher.feed(d) for d in ["Hel", "", "lo"]] == [StopCheck("Hel", False), StopCheck("", False),
                                                              StopCheck("lo", False)]
    assert matcher.flush() == ""


def test_stop_string_split_across_two_deltas():
    assert _stream(["END"], ["Hello E", "ND more"]) == (["Hello ", ""], True, "")


def test_stop_string_split_across_three_deltas():
    emitted, stopped, rest = _stream(["<|stop|>"], ["a <|", "st", "op|>b"])
    assert emitted == ["a ", "", ""] and stopped and rest == ""


def test_held_back_text_is_released_when_the_match_fails():
    emitted, stopped, rest = _stream(["END"], ["one E", "N", "d two"])
    assert emitted == ["one ", "", "ENd two"]
    assert not stopped and rest == ""


def test_hold_back_is_the_longest_prefix_suffix_not_a_fixed_length():
    matcher = StopStringMatcher(["abcdef"])
    assert matcher.feed("xxab") == StopCheck("xx", False)  # "ab" could start the stop string
    assert matcher.feed("cz") == StopCheck("abcz", False)  # it did not; nothing is held any more
    assert matcher.feed("aa") == StopCheck("a", False)  # only the last "a" is a prefix
    assert matcher.flush() == "a"


def test_flush_returns_the_text_still_held_at_the_end():
    emitted, stopped, rest = _stream(["###"], ["answer #", "#"])
    assert emitted == ["answer ", ""] and not stopped and rest == "##"


def test_output_never_contains_the_stop_string():
    deltas = ["The ", "answer", " is", " 4", "2.", "\n\n", "Question"]
    emitted, stopped, rest = _stream(["\n\n"], deltas)
    assert "".join(emitted) + rest == "The answer is 42." and stopped


def test_earliest_occurrence_wins_among_several_stop_strings():
    emitted, stopped, _ = _stream(["world", "lo w"], ["hello world"])
    assert emitted == ["hel"] and stopped
    emitted, stopped, _ = _stream(["cd", "bcd", "zz"], ["ab", "cdzz"])
    assert emitted == ["a", ""] and stopped  # "bcd" starts before "cd"


def test_a_stop_string_that_completes_first_ends_the_output():
    # "bc" completes while "abcd" is still only a prefix: generation stops at the first completed match.
    emitted, stopped, _ = _stream(["abcd", "bc"], ["xab", "c", "d"])
    assert emitted == ["x", "a"] and stopped


def test_stop_at_the_very_start():
    emitted, stopped, rest = _stream(["STOP"], ["STOP", "after"])
    assert emitted == [""] and stopped and rest == ""


def test_nothing_is_emitted_after_a_stop():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("abxcd") == StopCheck("ab", True)
    assert matcher.feed("more") == StopCheck("", True)
    assert matcher.flush() == ""


def test_unicode_stop_strings_and_text():
    emitted, stopped, _ = _stream(["🛑停"], ["héllo ", "wörld 🛑", "停 after"])
    assert emitted == ["héllo ", "wörld ", ""] and stopped
    emitted, stopped, rest = _stream(["🛑停"], ["日本 🛑", "語"])
    assert "".join(emitted) + rest == "日本 🛑語" and not stopped


def test_a_single_string_is_one_stop_string_and_empty_ones_are_rejected():
    assert _stream("ab", ["xa", "b"]) == (["x", ""], True, "")
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        StopStringMatcher(["ok", ""])

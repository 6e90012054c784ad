"""Row sources: a call's rows a window at a time, longest first as sentence-transformers orders them."""

from __future__ import annotations

from attnstore_client.call.sources import TextRows, Tokenized, TokenRows


def test_token_rows_come_longest_first_ties_in_input_order_in_windows() -> None:
    source = TokenRows([[1], [1, 2, 3], [4, 5], [6, 7, 8], [9]])
    windows = list(source.windows(2))
    assert [[p for p, _ in window.rows] for window in windows] == [[1, 3], [2, 0], [4]]
    assert windows[0].rows[0] == (1, Tokenized([1, 2, 3])) and [len(window) for window in windows] == [2, 2, 1]
    assert len(source) == 5


def test_text_rows_are_ordered_by_text_length_and_tokenized_one_window_at_a_time() -> None:
    asked: list[list[str]] = []

    def tokenize(texts: list[str]) -> list[list[int]]:
        asked.append(texts)
        return [[len(text)] for text in texts]

    source = TextRows(["bb", "a", "dddd", "ccc"], tokenize)
    windows = list(source.windows(3))
    assert [[p for p, _ in window.rows] for window in windows] == [[2, 3, 0], [1]]
    assert asked == [["dddd", "ccc", "bb"], ["a"]]  # never every text at once
    assert windows[1].rows == [(1, Tokenized([1]))]


def test_a_text_repeated_in_the_call_is_tokenized_once_and_comes_as_a_repeat_of_its_first() -> None:
    asked: list[str] = []

    def tokenize(texts: list[str]) -> list[list[int]]:
        asked.extend(texts)
        return [[len(text)] for text in texts]

    source = TextRows(["xy", "abc", "xy", "abc", "q", "xy"], tokenize)
    windows = list(source.windows(2))
    assert sorted(asked) == ["abc", "q", "xy"]
    repeats = [repeat for window in windows for repeat in window.repeats]
    assert sorted(repeats) == [(2, 0), (3, 1), (5, 0)]
    assert sum(len(window) for window in windows) == 6


def test_a_prompt_in_segments_is_tokenized_segment_by_segment_with_the_special_tokens_around_it() -> None:
    from attnstore_client.call.sources import segment_tokens
    from tests.support.caches import word_tokenizer

    tokenizer = word_tokenizer()
    [tokens] = segment_tokens(tokenizer, [["w2 w3", "w4", "w5 w6 w7"]], max_length=64)
    whole = tokenizer("w2 w3 w4 w5 w6 w7")["input_ids"]
    assert list(tokens.ids) == whole and tokens.segments == (2, 1, 3) and sum(tokens.segments) == len(whole)


def test_a_prompt_in_segments_longer_than_the_model_takes_is_refused_not_cut() -> None:
    import pytest

    from attnstore.errors import ConfigError
    from attnstore_client.call.sources import segment_tokens
    from tests.support.caches import word_tokenizer

    with pytest.raises(ConfigError, match="prompt 0 in segments is 4 tokens, over the model's 3"):
        segment_tokens(word_tokenizer(), [["w2 w3", "w4 w5"]], max_length=3)

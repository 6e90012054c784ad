"""Row sources: a call's rows a chunk at a time, longest first as sentence-transformers orders them."""

from __future__ import annotations

from attnstore_client.sources import TextRows, TokenRows


def test_token_rows_come_longest_first_ties_in_input_order_in_chunks() -> None:
    source = TokenRows([[1], [1, 2, 3], [4, 5], [6, 7, 8], [9]])
    chunks = list(source.chunks(2))
    assert [positions for positions, _ in chunks] == [[1, 3], [2, 0], [4]]
    assert chunks[0][1] == [[1, 2, 3], [6, 7, 8]]
    assert len(source) == 5


def test_text_rows_are_ordered_by_text_length_and_tokenized_one_chunk_at_a_time() -> None:
    asked: list[list[str]] = []

    def tokenize(texts: list[str]) -> list[list[int]]:
        asked.append(texts)
        return [[len(text)] for text in texts]

    source = TextRows(["bb", "a", "dddd", "ccc"], tokenize)
    chunks = list(source.chunks(3))
    assert [positions for positions, _ in chunks] == [[2, 3, 0], [1]]
    assert asked == [["dddd", "ccc", "bb"], ["a"]]  # never every text at once
    assert chunks[1][1] == [[1]]

"""Texts built to collide, for the differential fuzz harness: the same tokens reached by other texts.

all-MiniLM-L6-v2's tokenizer lowercases, strips accents and splits on any whitespace, and cuts
texts at 256 tokens: so case variants, accent variants, whitespace variants and over-long texts
that share their first 256 tokens all give one row, and a text repeated later in the call is a
repeat of whichever row its first occurrence resolved to.
"""

from __future__ import annotations

from hypothesis import strategies as st

# Real log lines (Loghub: HDFS, OpenSSH, Linux, Apache): templated, near-duplicate text.
LINES = (
    "Received block blk_-2020273862360001901 of size 67108864 from /10.250.7.244",
    "Received block blk_8408125361497769001 of size 67108864 from /10.251.70.211",
    "BLOCK* NameSystem.addStoredBlock: blockMap updated: 10.251.201.204:50010 is added to blk_9072829105973334075"
    " size 67108864",
    "10.250.5.237:50010 Served block blk_3166960787499091856 to /10.251.43.147",
    "Failed password for root from 5.36.59.76 port 42393 ssh2",
    "Failed password for root from 112.95.230.3 port 45378 ssh2",
    "Failed password for uucp from 103.207.39.212 port 51528 ssh2",
    "Received disconnect from 103.207.39.212: 11: Closed due to user request. [preauth]",
    "session opened for user cyrus by (uid=0)",
    "connection from 222.33.90.199 () at Mon Jun 20 03:40:59 2005",
    "cupsd shutdown succeeded",
    "jk2_init() Found child 32564 in scoreboard slot 10",
    "jk2_init() Found child 32565 in scoreboard slot 11",
    "Quick Brown Fox",
    "café crème at the Zürich office",
)
STORED = LINES[:5]  # ingested with their outputs: exact hits
MAPS_ONLY = LINES[5:9]  # ingested with maps alone: a query with their tokens is a map hit (distance 0)


def _variant(text: str, how: str) -> str:
    """``text`` changed in a way the tokenizer does not see (or, for "long", past its length limit)."""
    if how == "upper":
        return text.upper()
    if how == "lower":
        return text.lower()
    if how == "title":
        return text.title()
    if how == "spaces":
        return "  " + text.replace(" ", "   ") + " "
    if how == "tabs":
        return text.replace(" ", "\t").replace(".", " .") + "\n"
    if how == "accents":
        return text.replace("e", "é").replace("a", "à")
    if how == "long":  # over 256 tokens: truncated, so two long variants of one line collide
        return " ".join([text] * 40)
    if how == "long_tail":  # the same first 256 tokens as "long", another tail
        return " ".join([text] * 40) + " and then something else entirely"
    return text


VARIANTS = ("same", "upper", "lower", "title", "spaces", "tabs", "accents", "long", "long_tail")


@st.composite
def colliding_texts(draw: st.DrawFn) -> str:
    """One text: a line, maybe varied; sometimes empty, unicode or unknown."""
    kind = draw(st.sampled_from(("line", "line", "line", "line", "empty", "unicode")))
    if kind == "empty":
        return draw(st.sampled_from(("", " ", "\n")))
    if kind == "unicode":
        return draw(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12))
    return _variant(draw(st.sampled_from(LINES)), draw(st.sampled_from(VARIANTS)))


@st.composite
def colliding_calls(draw: st.DrawFn, max_rows: int) -> list[str]:
    """A call's texts: drawn from a small pool of colliding texts, so repeats and duplicates are many."""
    pool = draw(st.lists(colliding_texts(), min_size=1, max_size=12))
    size = draw(st.sampled_from((1, 2, 5, 12, max_rows // 2, max_rows)))  # long calls cross windows of the stream
    picks = draw(st.lists(st.integers(0, len(pool) - 1), min_size=size, max_size=size))
    return [pool[p] for p in picks]

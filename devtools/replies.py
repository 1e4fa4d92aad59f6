"""Judging a small model's replies by their words: English or not, repeating or not.

Shared by the demo model's measurement (``python -m bench.demo_model``) and the tests that
check what a user gets from it (tests/engine/test_model_defaults.py). A reply is judged
English by the share of its words that are common English words (``english_share``):
0.4-0.6 for SmolLM2-135M-Instruct's English replies, below 0.15 for its French, Italian or
word-salad ones (measured over 300 replies, 64 tokens, float32). It *repeats* when a run of
three words comes back three times or more ("Il Coriobella, il Coriobella, il
Coriobella, ..."), or one character runs on ("Mmmmmmmmmm")."""

from __future__ import annotations

import re
from collections import Counter

# The most common English words (function words and everyday verbs, nouns, adjectives).
COMMON_ENGLISH = frozenset(
    """the be to of and a in that have i it for not on with he as you do at this but his by from
    they we say her she or an will my one all would there their what so up out if about who get
    which go me when make can like time no just him know take people into year your good some
    could them see other than then now look only come its over think also back after use two how
    our work first well way even new want because any these give day most us is are was were has
    had been am does did can't don't i'm it's that's there's you're i'll i'd let's here more very
    many much such may might should must own same few each both while where why yes really always
    never often sometimes something someone anything everything great best better little long high
    old big small help try find tell ask need feel seem leave call keep start show hear play run
    move live believe bring happen write sit stand lose pay meet include continue set learn change
    lead understand watch follow stop create speak read allow add spend grow open walk win offer
    remember love consider appear buy wait serve die send expect build stay fall cut reach remain
    suggest raise pass sell require report decide pull""".split()
)
ENGLISH_SHARE = 0.25  # a reply at or above it is English
REPEATED_NGRAM = 3  # words
REPEATS = 3  # times


def english_share(text: str) -> float:
    """The share of the text's words that are common English words (0 for no words)."""
    words = re.findall(r"[a-z']+", text.lower())
    return sum(word in COMMON_ENGLISH for word in words) / len(words) if words else 0.0


def is_english(text: str) -> bool:
    return english_share(text) >= ENGLISH_SHARE


def repeats(text: str) -> bool:
    """A run of REPEATED_NGRAM words (punctuation left out) that comes back REPEATS times or
    more, or a character repeated ten times in a row. Three sentences that start alike ("They
    are ...") do not repeat; "high-performance, low-latency, high-performance, ..." does."""
    if re.search(r"(\w)\1{9,}", text):
        return True
    words = re.findall(r"[\w']+", text.lower())
    grams = Counter(tuple(words[i : i + REPEATED_NGRAM]) for i in range(len(words) - REPEATED_NGRAM + 1))
    return any(count >= REPEATS for count in grams.values())


def markup(text: str) -> bool:
    """Tool-call markup in a reply that should be a sentence (<tool_response>, <tool_call>)."""
    return bool(re.search(r"</?tool_(response|call)>", text))

#!/usr/bin/env python3
"""gen_rnn_corpus.py - writes rnn_corpus.txt, the word-level corpus of examples/rnn.c.

Simple English sentences from a small hand-written grammar (agreement between subject and verb,
adjectives, prepositional phrases, relative clauses, a few fixed idioms), one sentence a line,
punctuation as separate tokens. Deterministic (seeded); public domain. Usage:
    python3 examples/data/gen_rnn_corpus.py > examples/data/rnn_corpus.txt
"""
import random

rng = random.Random(1234)
ANIMALS = "cat dog fox bird horse cow sheep goat mouse rabbit owl duck frog bear wolf deer".split()
PEOPLE = "farmer teacher child baker doctor sailor girl boy king queen miller painter driver".split()
THINGS = "ball book cup box hat coat chair table lamp basket letter key boat cart stone apple".split()
PLACES = "garden river house forest field village market road hill barn kitchen school bridge".split()
ADJ = "small big old young red green brown quiet happy tired hungry clever lazy bright cold warm".split()
ADV = "slowly quickly quietly often never always carefully happily".split()
VI = [("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"),
      ("walks", "walk"), ("laughs", "laugh"), ("rests", "rest"), ("plays", "play")]
VT = [("sees", "see"), ("finds", "find"), ("carries", "carry"), ("likes", "like"),
      ("watches", "watch"), ("follows", "follow"), ("holds", "hold"), ("wants", "want"),
      ("paints", "paint"), ("buys", "buy")]
PAST_I = "slept ran sang waited walked laughed rested played".split()
PAST_T = "saw found carried liked watched followed held wanted painted bought".split()
PREP = "in near behind under beside across".split()
TIME = ["in the morning", "at night", "every day", "after the rain", "before dinner",
        "in the winter", "on sunday", "at noon"]


def noun_phrase(plural=None, kinds=(ANIMALS, PEOPLE)):
    kind = rng.choice(kinds)
    n = rng.choice(kind)
    if plural is None:
        plural = rng.random() < 0.3
    if plural:
        n = n + ("es" if n.endswith(("x", "s", "sh", "ch")) else "s")
        det = rng.choice(["the", "some", "two", "many", "the"])
    else:
        det = rng.choice(["the", "the", "a", "this", "that", "my", "our"])
        if det == "a" and n[0] in "aeiou":
            det = "an"
    words = [det]
    if rng.random() < 0.4:
        a = rng.choice(ADJ)
        if det == "an" and a[0] not in "aeiou":
            words[0] = "a"
        elif det == "a" and a[0] in "aeiou":
            words[0] = "an"
        words.append(a)
    words.append(n)
    return words, plural


def place():
    return [rng.choice(PREP), "the", rng.choice(PLACES)]


def clause():
    subj, pl = noun_phrase()
    past = rng.random() < 0.35
    if rng.random() < 0.45:
        v = rng.choice(PAST_I) if past else rng.choice(VI)[1 if pl else 0]
        words = subj + [v]
        if rng.random() < 0.3:
            words.append(rng.choice(ADV))
    else:
        i = rng.randrange(len(VT))
        v = PAST_T[i] if past else VT[i][1 if pl else 0]
        obj, _ = noun_phrase(kinds=(ANIMALS, PEOPLE, THINGS))
        words = subj + [v] + obj
    if rng.random() < 0.5:
        words += place()
    if rng.random() < 0.25:
        words += rng.choice(TIME).split()
    return words


def sentence():
    r = rng.random()
    if r < 0.08:
        n = rng.choice(PEOPLE)
        return ["once", "upon", "a", "time", "there", "was", "a", n, "who", "lived", "in", "a",
                rng.choice(ADJ), rng.choice(PLACES), "."]
    if r < 0.14:
        return ["the", "end", "."]
    if r < 0.22:
        subj, pl = noun_phrase()
        return ["where", "do" if pl else "does"] + subj + [rng.choice(VI)[1], "?"]
    words = clause()
    if rng.random() < 0.3:
        words += [rng.choice(["and", "but", "because", "while"])] + clause()
    if rng.random() < 0.15:
        subj, pl = noun_phrase()
        words = subj + ["said", "that"] + words
    return words + ["."]


lines, size = [], 0
while size < 120_000:
    line = " ".join(sentence() + sentence())
    lines.append(line)
    size += len(line) + 1
print("\n".join(lines))

"""The evaluation texts: a deterministic long text of numbered facts, and the passcode retrieval
prompt (a needle at a chosen depth of a filler haystack).
"""

from __future__ import annotations

import numpy as np


_NAMES = ["Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
          "Kira", "Leon", "Mara", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara"]
_PLACES = ["Marrow Bay", "the old mill", "Glenford", "the harbour market", "Ashby Hill",
           "the river crossing", "Northwick", "the lighthouse", "Fenwater", "the stone bridge",
           "Kestrel Point", "the orchard", "Holloway", "the clock tower", "Brindle Cove"]
_OBJECTS = ["a brass compass", "a blue lantern", "a wooden flute", "a silver key", "a red kite",
            "a leather map", "a copper kettle", "a glass bottle", "a green umbrella", "a tin whistle",
            "a carved chess set", "a linen sail", "an iron anchor", "a painted drum"]
_VERBS = ["found", "sold", "repaired", "painted", "lost", "buried", "bought", "borrowed", "hid",
          "carried"]
_DETAILS = [
    "The morning was cold and the streets were quiet.",
    "Nobody in town could remember a stranger day.",
    "Rain had fallen for three days before it happened.",
    "The neighbours talked about it for weeks afterwards.",
    "It was written down carefully in the town ledger.",
    "A small crowd gathered to watch from a distance.",
    "The wind came in from the sea and smelled of salt.",
    "Later that evening the bells rang twice.",
]


def _fact(i: int) -> tuple[str, str, str, str, int]:
    return (_NAMES[(7 * i + 3) % len(_NAMES)], _VERBS[(3 * i + 1) % len(_VERBS)],
            _OBJECTS[(5 * i + 2) % len(_OBJECTS)], _PLACES[(11 * i + 4) % len(_PLACES)],
            1800 + (37 * i + 11) % 200)


def long_text_paragraph(i: int) -> str:
    """Paragraph i of the deterministic long text: a numbered fact, a detail, and every third
    paragraph a recall of an earlier fact (long-range copying, where attention quality shows)."""
    name, verb, obj, place, year = _fact(i)
    out = [f"Fact {i + 1}: In {year}, {name} {verb} {obj} at {place}.",
           _DETAILS[(i * 5) % len(_DETAILS)]]
    if i >= 6 and i % 3 == 0:
        j = (i * 13) % (i - 2)
        n2, v2, o2, p2, y2 = _fact(j)
        out.append(f"As fact {j + 1} records, in {y2} {n2} {v2} {o2} at {p2}.")
    return " ".join(out)


def long_text_ids(tok, n_tokens: int) -> list[int]:
    """The first n_tokens token ids of the deterministic long text."""
    n_par = 32
    while True:
        ids = tok.encode("\n\n".join(long_text_paragraph(i) for i in range(n_par)),
                         add_special_tokens=False)
        if len(ids) >= n_tokens:
            return list(ids[:n_tokens])
        if n_par > 1 << 20:
            raise RuntimeError(f"tokenizer gave only {len(ids)} tokens for {n_par} paragraphs")
        n_par *= 2


_FILLER = [
    "The grass grows slowly in the shade of the tall trees.",
    "A gardener waters the roses early, before the sun is high.",
    "Clouds drift over the valley and the hills turn grey and then gold.",
    "The library is quiet in the afternoon, and the pages turn softly.",
    "Boats rock gently against the pier while the gulls call overhead.",
    "In the kitchen, bread rises under a clean white cloth.",
    "The train crosses the plain without hurry, its windows full of light.",
    "Children chalk pictures on the pavement and the rain washes them away.",
    "An old dog sleeps by the fire, dreaming of long walks.",
    "The market opens at dawn with baskets of apples and pears.",
    "Snow settles on the rooftops and the town grows still.",
    "A letter waits on the table, sealed and not yet read.",
]

NEEDLE = "The secret passcode is {code}."
QUESTION = "What is the secret passcode? Answer with the number only."


def passcode(length: int, depth: float, rep: int) -> int:
    """A deterministic five-digit code per (length, depth, repetition)."""
    rng = np.random.default_rng([int(length), int(round(depth * 1000)), int(rep), 20260501])
    return int(rng.integers(10000, 100000))


def retrieval_prompt_ids(tok, length: int, depth: float, code: int) -> list[int]:
    """Prompt of about `length` tokens (never more): filler with the needle at fraction `depth`
    of the haystack, then the question; wrapped in the chat template when the tokenizer has one."""
    def render(n_filler: int) -> list[int]:
        sents = [_FILLER[i % len(_FILLER)] for i in range(n_filler)]
        sents.insert(int(round(depth * n_filler)), NEEDLE.format(code=code))
        content = " ".join(sents) + "\n\n" + QUESTION
        if getattr(tok, "has_chat_template", False):
            text = tok.apply_chat_template([{"role": "user", "content": content}])
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(content)

    per = max(1, len(tok.encode(" ".join(_FILLER), add_special_tokens=False)) / len(_FILLER))
    n = max(0, int((length - len(render(0))) / per))
    ids = render(n)
    while len(ids) > length and n > 0:        # shrink until it fits
        n = max(0, n - max(1, (len(ids) - length) // int(per) + 1))
        ids = render(n)
    return ids


"""Prompt text from word ids: deterministic content for named blocks, rendered as text.

A workload says *which* content a prompt holds (blocks named by a key) and how long it is;
this module turns a key into words. Equal keys give equal words, so prompts that share a
block share its text exactly and a server's prefix cache can reuse it. Each word below is
one token with or without a leading space in SmolLM2's tokenizer (checked when the list was
chosen: 1,000 random words of it encode to exactly 1,000 tokens), and common English words
are single tokens in most BPE vocabularies, so a prompt of N words is about N tokens. The
server's ``usage.prompt_tokens`` reports the exact count.

Word ids double as token ids for a simulator that wants tokens, not text (``VOCAB_SIZE``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

WORDS: tuple[str, ...] = tuple(
    """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change reason research girl moment air teacher force education foot
    boy age policy process music market sense nation plan college interest death experience
    effect class control care field development role rate heart drug show leader light voice
    wife mind price report decision son view relationship town road arm difference value
    building action model season tax director position player record paper space ground form
    event official matter center site project activity star table need court oil cost
    industry figure street image phone data picture practice piece land product doctor wall
    patient worker news test movie north love support technology step baby computer type
    attention film tree source organization hair window evidence population truth song blood
    rock river church chair cup plate bread milk sugar salt fish bird dog cat horse animal
    plant flower grass sea lake hill forest park bridge train ship boat plane bus wheel
    engine machine tool box bag glass stone metal gold iron wood fire snow rain wind cloud
    sun moon sky color red blue green yellow black white brown small large big little long
    short high low young old new good bad great best better early late hard easy simple
    strong weak fast slow hot cold warm cool dark bright clean full empty open close quiet
    rich poor happy free true real clear whole main public private local national general
    special common human natural social political economic military medical legal final
    major minor single double able ready available possible important different similar
    certain recent several past present future left top bottom middle inside outside above
    below under over between among through during before after around along against without
    within upon about into onto from with like than then when where what which while who why
    how all any each every both either some many much more most few less least other another
    such same own only just also very still even too again once never always often sometimes
    usually already soon later now here there today run walk talk say tell ask answer call
    come go get make take give find think know see look watch listen feel keep let begin
    start stop help play move live die hold write read learn build buy sell pay send receive
    pull push turn cut break fall rise grow stand sit lie lead follow leave stay wait win
    fight kill save drive fly eat sleep wake dream want miss remember forget understand
    describe choose agree allow offer create develop reduce include require exist consider
    suggest expect prevent prepare represent return apply avoid catch
    """.split()  # noqa: SIM905 (512 words read better as text than as a list literal)
)
VOCAB_SIZE = len(WORDS)
assert VOCAB_SIZE == 512, VOCAB_SIZE


def block_word_ids(namespace: str, key: str, num_words: int) -> list[int]:
    """The first ``num_words`` words of block ``key`` in ``namespace``.

    Prefix-consistent: the first n words of a block are the same whatever length is asked,
    so a trace's partial last block is a prefix of the full block with the same id.
    """
    assert num_words >= 0, num_words
    # random.Random seeds a str through SHA-512: stable across runs and Python versions.
    rng = random.Random(f"{namespace}/{key}")
    return rng.choices(range(VOCAB_SIZE), k=num_words)


def render_text(word_ids: Iterable[int]) -> str:
    return " ".join(WORDS[i] for i in word_ids)

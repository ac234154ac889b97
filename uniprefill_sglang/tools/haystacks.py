"""Haystacks for the needle tasks: the text a needle hides in, written for this project.

RULER (Hsieh et al., 2024) hides its needles in one of a few kinds of filler; the first three
are local stand-ins of its three shapes, in our own words, the fourth a register of our own:

* ``noise``: the same five short sentences over and over ("The grass is green. The sky is
  blue. ..."): no content a needle could be confused with, and trivially repetitive.
* ``prose``: plain sentences about a small town's day (weather, shops, people, errands), the
  pool reshuffled every round by the case's seed: ordinary narrative text with no repetition
  inside a round.
* ``essay``: a short essay of our own on learning a craft, repeated paragraph after paragraph
  (RULER repeats long essays): argued, connected text, the hardest of the three for a model to
  skip.
* ``manual``: the care instructions of a home aquarium, imperative and technical, their steps
  in order and repeated: a fourth register, for reporting on a haystack that calibration on
  the other three never saw.

``essay`` and ``manual`` are the same text for every tuning and validation seed. On test seeds
(``seeds.TEST_SEEDS``) they change with the seed, so that a test case is new text and not only
new needles: every round of the essay puts its paragraphs in a seeded order, every round of the
manual starts at a seeded step (then runs through all steps in order).

A haystack is a list of units (sentences), so that a needle is inserted between sentences;
``units(kind, n, seed)`` is a prefix of ``units(kind, n + 1, seed)`` (the token count grows with
``n``, which the binary search that fills a token budget relies on). No unit holds a digit, a
word of tasks.py's needle vocabulary (keys and word values), or the phrases the questions ask
about ("special magic", "pass key", "value", "VAR"); ``tests/test_haystacks.py`` checks it.
"""

from __future__ import annotations

import random

from uniprefill_sglang.tools.seeds import TEST_SEEDS

HAYSTACKS = ("noise", "prose", "essay", "manual")

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Plain sentences about one ordinary day in a town; shuffled per round.
PROSE_SENTENCES = (
    "The baker on the corner opened her shop before the street lamps went out.",
    "A light rain started around noon and stopped again an hour later.",
    "Two boys argued about football on the steps of the library.",
    "The bus to the station was late, so most people decided to walk.",
    "An old man fed the pigeons with crumbs from a paper bag.",
    "The post office closed early because the clerk had a cold.",
    "Somebody had left a red scooter leaning against the fence.",
    "The smell of fresh coffee drifted out of the café by the square.",
    "A delivery van blocked the narrow lane for almost twenty minutes.",
    "The teacher wrote the homework on the board and reminded everyone twice.",
    "In the park a dog chased a ball that nobody had thrown.",
    "The grocer stacked oranges into a neat pyramid near the door.",
    "A woman in a blue coat asked for directions to the museum.",
    "The church bell rang at noon, as it had done for many years.",
    "Children drew chalk pictures on the pavement after school.",
    "The wind turned cold in the afternoon and people buttoned their coats.",
    "A cat slept on the warm roof of a parked car.",
    "The mayor gave a short speech that few people stayed to hear.",
    "At the market a farmer sold potatoes, onions and cabbages.",
    "The barber told the same joke to every customer that day.",
    "A young couple carried a heavy sofa up three flights of stairs.",
    "The train whistle could be heard from the far side of the valley.",
    "The librarian sorted the returned books into tidy piles.",
    "Clouds gathered over the hills but the rain never came back.",
    "A boy sold cold juice from a small table outside his house.",
    "The painter finished the last wall of the school hall before dark.",
    "Two neighbours talked over the hedge about their gardens.",
    "The pharmacist checked the prescription carefully before handing it over.",
    "Evening came slowly, and the shop fronts began to glow.",
    "The cook at the inn prepared a thick soup for the evening guests.",
    "A group of tourists took photographs of the old town gate.",
    "The last bus of the day left the square almost empty.",
)

# An essay of our own (on learning a craft), one tuple per paragraph; repeated in order.
ESSAY_PARAGRAPHS = (
    ("Most people who want to learn a craft start by looking for the right method.",
     "They read about tools, compare courses and wait for the moment when they feel ready.",
     "That moment rarely comes, because readiness is a result of practice and not a condition "
     "for it.",
     "The beginners who improve fastest are usually the ones who start before they understand "
     "very much."),
    ("The first work anyone makes is bad, and it is supposed to be.",
     "A clumsy first attempt is not a verdict on talent; it is information about what to try "
     "next.",
     "The danger is not the bad work itself but the temptation to stop making it.",
     "Someone who makes many poor things learns more than someone who plans one perfect thing "
     "for a year."),
    ("Good teachers understand this and keep the early steps small.",
     "They ask for something that can be finished in an afternoon, then ask for it again a "
     "little better.",
     "Each round is short enough that failure costs little, and long enough that progress can "
     "be seen.",
     "Over months the small rounds add up to a skill that no single lesson could have "
     "delivered."),
    ("Feedback matters more than effort alone.",
     "Practice without anyone pointing out mistakes tends to repeat the same mistakes, only "
     "faster.",
     "The useful kind of feedback is specific: it names one thing to change and says why.",
     "General praise feels pleasant, but it does not tell the learner where to look."),
    ("There is also the question of taste.",
     "Beginners can often see that their work falls short long before they can fix it.",
     "This gap between what they can judge and what they can make is uncomfortable, and many "
     "people quit while they are inside it.",
     "Yet the gap is a good sign: it means their judgement is already ahead of their hands, "
     "and the hands will follow."),
    ("Finally, a craft is learned among other people.",
     "Watching others work shows shortcuts that no book describes, and showing one's own work "
     "invites the criticism that speeds things up.",
     "Communities of practice also keep people going on the days when motivation is low.",
     "In the end the method matters less than the habit of making, showing and making again."),
)
ESSAY_SENTENCES = tuple(s for paragraph in ESSAY_PARAGRAPHS for s in paragraph)

# Care instructions of our own (a home aquarium), in order; repeated.
MANUAL_SENTENCES = (
    "Before you fill the tank, place it on a level stand that can carry its full weight.",
    "Rinse the gravel in a bucket until the water running off it is clear.",
    "Spread the gravel so that it slopes gently from the back of the tank to the front.",
    "Fit the filter to the back wall and make sure its intake sits well below the surface.",
    "Fill the tank slowly, pouring the water onto a plate so that the gravel is not disturbed.",
    "Add a water conditioner to remove the chlorine that tap water usually contains.",
    "Switch on the heater only after it has been under water for at least a quarter of an hour.",
    "Check the thermometer each morning during the first week and adjust the heater if needed.",
    "Leave the filter running for several weeks before you add any fish.",
    "During that time useful bacteria settle in the filter and break down waste.",
    "Test the water once a week with a simple kit from any pet shop.",
    "Introduce the first fish in small groups rather than all at once.",
    "Float the closed bag on the surface for a while so that the temperatures can even out.",
    "Feed the fish sparingly, no more than they can eat in a couple of minutes.",
    "Remove any food that is left over, because it spoils the water quickly.",
    "Replace a fifth of the water every week with conditioned water of the same temperature.",
    "Clean the glass from the inside with a soft scraper that will not scratch it.",
    "Rinse the filter sponge in old tank water, never under the tap.",
    "Trim the plants when their leaves begin to crowd the surface.",
    "Keep the lid closed, since some fish jump when they are startled.",
    "Do not place the tank in direct sunlight, which encourages algae to grow.",
    "Run the light for about eight hours a day on a timer.",
    "If the water turns cloudy, reduce feeding and wait a few days before doing anything else.",
    "Watch the fish for a short time every day to notice changes in their behaviour.",
    "A fish that hides all day or stops eating may need a separate tank for a while.",
    "Unplug every device before you put your hands into the water.",
    "Keep a towel nearby, because small spills happen during every cleaning.",
    "Write down each water change and test result in a notebook kept beside the tank.",
    "When you travel, ask a neighbour to feed the fish rather than leaving extra food.",
    "Replace the heater and the filter parts when they show signs of wear.",
    "Most problems in a home aquarium come from overfeeding and from changing too much at once.",
    "Patience is the most useful habit a keeper of fish can learn.",
)


def _round(kind: str, seed: int, r: int) -> list[str]:
    """Round ``r`` of a seeded haystack: every sentence of the pool once."""
    rng = random.Random(f"{kind}:{seed}:{r}")
    if kind == "prose":
        return rng.sample(PROSE_SENTENCES, len(PROSE_SENTENCES))
    if kind == "essay":  # paragraphs reordered, each paragraph's argument kept in order
        return [s for p in rng.sample(ESSAY_PARAGRAPHS, len(ESSAY_PARAGRAPHS)) for s in p]
    start = rng.randrange(len(MANUAL_SENTENCES))  # manual: the steps in order from ``start``
    return list(MANUAL_SENTENCES[start:] + MANUAL_SENTENCES[:start])


def units(kind: str, n: int, seed: int = 0) -> list[str]:
    """The first ``n`` sentences of haystack ``kind``. ``seed`` orders the ``prose`` rounds, and
    on test seeds (``seeds.TEST_SEEDS``) the ``essay`` and ``manual`` rounds too: their text
    on tuning and validation seeds is the fixed repetition every recorded case was built from."""
    if kind not in HAYSTACKS:
        raise ValueError(f"unknown haystack {kind!r}; expected one of {HAYSTACKS}")
    if kind == "noise" or (kind in ("essay", "manual") and seed not in TEST_SEEDS):
        pool = {"noise": NOISE_SENTENCES, "essay": ESSAY_SENTENCES,
                "manual": MANUAL_SENTENCES}[kind]
        return [pool[i % len(pool)] for i in range(n)]
    out: list[str] = []
    r = 0
    while len(out) < n:
        out.extend(_round(kind, seed, r))
        r += 1
    return out[:n]


def min_unit_tokens(kind: str) -> int:
    """A lower bound on a unit's tokens (an upper bound on units for a budget)."""
    return 3 if kind == "noise" else 8

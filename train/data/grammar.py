"""The built-in generated tasks: `toy_translation`, four symbol tasks and `toy_classification`.

Everything here is a pure function of a seed, drawn only through `random.Random.random()`
(whose sequence Python guarantees across versions and machines) and SHA-256, so every machine
generates the same examples.

`toy_translation` translates a small English-like language into an invented one. The target
language differs from the source in ways that force a non-monotonic alignment:

* noun phrases are `noun adjectives determiner`, with a postpositional phrase in front:
  "the big dog near a river" -> "mekvu nu nera mivgu ritpo ku";
* clauses are verb-final (subject, object, adverb, verb): "the dog sees a cat ." ->
  "mivgu ku gasgu nu mivpit .";
* adjectives and determiners agree with their noun's class (A/B) and number, verbs agree with
  their subject's number and carry tense; negation is a verb prefix.

Example (pretty-printed; the strings are single-spaced):

    the big dogs  did not see  a cat  quickly .
    mivgui ritpoi kui  gasgu nu  kovgi  nomivpont .

`toy_classification` labels the English side "grammatical" or "ungrammatical": an
ungrammatical sentence has its first clause's verb in the other number ("the dogs sees a
cat .", "my child do not sleep ."). Only sentences whose first clause is in the present tense
and whose subject shows its number ("the fish" does not) are used, and that subject has no
prepositional phrase (no noun of another number between it and its verb). The subject's
number and the label are fair coins, so neither the verb nor the subject alone tells the
label.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from models.errors import UserError

# ---------------------------------------------------------------------------------------------
# Lexicon. Nouns: (singular, plural). Verbs: (base, third person singular, past).

NOUNS = [
    ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("horse", "horses"), ("fish", "fish"),
    ("man", "men"), ("woman", "women"), ("child", "children"), ("mouse", "mice"),
    ("teacher", "teachers"), ("student", "students"), ("farmer", "farmers"),
    ("king", "kings"), ("queen", "queens"), ("doctor", "doctors"), ("friend", "friends"),
    ("baker", "bakers"), ("sailor", "sailors"), ("singer", "singers"), ("writer", "writers"),
    ("painter", "painters"), ("soldier", "soldiers"), ("neighbour", "neighbours"),
    ("wolf", "wolves"), ("fox", "foxes"), ("bear", "bears"), ("goat", "goats"), ("cow", "cows"),
    ("sheep", "sheep"), ("frog", "frogs"), ("snake", "snakes"), ("owl", "owls"),
    ("book", "books"), ("letter", "letters"), ("apple", "apples"), ("bread", "breads"),
    ("cake", "cakes"), ("cup", "cups"), ("chair", "chairs"), ("table", "tables"),
    ("door", "doors"), ("window", "windows"), ("house", "houses"), ("boat", "boats"),
    ("car", "cars"), ("tree", "trees"), ("flower", "flowers"), ("stone", "stones"),
    ("river", "rivers"), ("mountain", "mountains"), ("village", "villages"), ("city", "cities"),
    ("garden", "gardens"), ("field", "fields"), ("road", "roads"), ("bridge", "bridges"),
    ("song", "songs"), ("story", "stories"), ("picture", "pictures"), ("box", "boxes"),
    ("key", "keys"), ("coat", "coats"), ("hat", "hats"), ("shoe", "shoes"), ("bag", "bags"),
    ("lamp", "lamps"), ("clock", "clocks"), ("ball", "balls"), ("ship", "ships"),
    ("castle", "castles"), ("forest", "forests"), ("island", "islands"), ("lake", "lakes"),
    ("star", "stars"), ("cloud", "clouds"), ("egg", "eggs"), ("basket", "baskets"),
    ("rope", "ropes"), ("candle", "candles"), ("mirror", "mirrors"), ("map", "maps"),
    ("ring", "rings"), ("sword", "swords"), ("drum", "drums"), ("bell", "bells"),
]

ADJECTIVES = [
    "big", "small", "old", "young", "red", "blue", "green", "white", "black", "happy", "sad",
    "quiet", "loud", "fast", "slow", "tall", "short", "clever", "brave", "kind", "cruel",
    "rich", "poor", "heavy", "light", "warm", "cold", "wet", "dry", "clean", "dirty", "new",
    "strange", "famous", "hungry", "tired", "angry", "gentle", "wild", "tiny", "huge",
    "bright", "dark", "sweet", "bitter", "soft", "hard", "round", "empty", "golden",
]

TRANSITIVE_VERBS = [
    ("see", "sees", "saw"), ("like", "likes", "liked"), ("find", "finds", "found"),
    ("help", "helps", "helped"), ("follow", "follows", "followed"), ("carry", "carries",
    "carried"), ("push", "pushes", "pushed"), ("pull", "pulls", "pulled"), ("paint", "paints",
    "painted"), ("build", "builds", "built"), ("buy", "buys", "bought"), ("sell", "sells",
    "sold"), ("hold", "holds", "held"), ("watch", "watches", "watched"), ("hear", "hears",
    "heard"), ("take", "takes", "took"), ("bring", "brings", "brought"), ("open", "opens",
    "opened"), ("close", "closes", "closed"), ("break", "breaks", "broke"), ("clean", "cleans",
    "cleaned"), ("cook", "cooks", "cooked"), ("eat", "eats", "ate"), ("draw", "draws", "drew"),
    ("chase", "chases", "chased"), ("catch", "catches", "caught"), ("visit", "visits",
    "visited"), ("remember", "remembers", "remembered"), ("hide", "hides", "hid"),
    ("wash", "washes", "washed"), ("throw", "throws", "threw"), ("love", "loves", "loved"),
    ("fear", "fears", "feared"), ("need", "needs", "needed"), ("want", "wants", "wanted"),
    ("keep", "keeps", "kept"), ("lose", "loses", "lost"), ("meet", "meets", "met"),
    ("call", "calls", "called"), ("greet", "greets", "greeted"),
]

INTRANSITIVE_VERBS = [
    ("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("walk", "walks", "walked"),
    ("sing", "sings", "sang"), ("dance", "dances", "danced"), ("laugh", "laughs", "laughed"),
    ("cry", "cries", "cried"), ("wait", "waits", "waited"), ("swim", "swims", "swam"),
    ("fly", "flies", "flew"), ("fall", "falls", "fell"), ("shout", "shouts", "shouted"),
    ("smile", "smiles", "smiled"), ("rest", "rests", "rested"), ("work", "works", "worked"),
    ("play", "plays", "played"), ("listen", "listens", "listened"), ("jump", "jumps",
    "jumped"), ("arrive", "arrives", "arrived"), ("leave", "leaves", "left"),
]

ADVERBS = [
    "quickly", "slowly", "quietly", "loudly", "today", "yesterday", "again", "often", "rarely",
    "happily", "sadly", "carefully", "early", "late", "together", "alone", "here", "there",
    "gladly", "suddenly",
]

PREPOSITIONS = {
    "near": "nera", "with": "kon", "behind": "tras", "under": "sub", "beside": "lat",
    "without": "sen", "above": "supa", "inside": "intu",
}

# Determiners: English form by number, then target form by (class, number).
DETERMINERS = {
    "the": {"sg": "the", "pl": "the", "A": ("ka", "kai"), "B": ("ku", "kui")},
    "a": {"sg": "a", "pl": "some", "A": ("na", "sai"), "B": ("nu", "soi")},
    "this": {"sg": "this", "pl": "these", "A": ("ta", "tai"), "B": ("tu", "tui")},
    "my": {"sg": "my", "pl": "my", "A": ("ma", "mai"), "B": ("mu", "mui")},
}

CONJUNCTIONS = {"and": "i", "but": "ba"}

NOUN_SUFFIX = {("A", "sg"): "a", ("A", "pl"): "ai", ("B", "sg"): "u", ("B", "pl"): "ui"}
ADJECTIVE_SUFFIX = {("A", "sg"): "e", ("A", "pl"): "ei", ("B", "sg"): "o", ("B", "pl"): "oi"}
VERB_SUFFIX = {("present", "sg"): "it", ("present", "pl"): "ant",
               ("past", "sg"): "ot", ("past", "pl"): "ont"}
NEGATION_PREFIX = "no"

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _stem(lemma: str, salt: int) -> str:
    """Deterministic invented stem: consonant-vowel-consonant-consonant from SHA-256."""
    digest = hashlib.sha256(f"{lemma}/{salt}".encode()).digest()
    c = _CONSONANTS
    return (c[digest[0] % len(c)] + _VOWELS[digest[1] % 5] + c[digest[2] % len(c)]
            + c[digest[3] % len(c)])


def _build_stems() -> dict[str, str]:
    """One unique stem per lemma (nouns, adjectives, verbs, adverbs), collisions resalted."""
    lemmas = ([n for n, _ in NOUNS] + ADJECTIVES + [v for v, _, _ in TRANSITIVE_VERBS]
              + [v for v, _, _ in INTRANSITIVE_VERBS] + ADVERBS)
    stems: dict[str, str] = {}
    taken: set[str] = set()
    for lemma in lemmas:
        key = lemma if lemma not in stems else lemma + "#2"   # "clean" is adjective and verb
        salt = 0
        while (stem := _stem(key, salt)) in taken:
            salt += 1
        stems[key] = stem
        taken.add(stem)
    return stems


STEMS = _build_stems()
_VERB_KEY = {v: (v + "#2" if v in ADJECTIVES else v)
             for v, _, _ in TRANSITIVE_VERBS + INTRANSITIVE_VERBS}


def noun_class(noun: str) -> str:
    """Grammatical class, "A" or "B", fixed by the noun's stem."""
    return "A" if hashlib.sha256(noun.encode()).digest()[0] % 2 == 0 else "B"


# ---------------------------------------------------------------------------------------------
# Syntax trees.

@dataclasses.dataclass(frozen=True)
class NounPhrase:
    """`det adjectives noun [preposition NounPhrase]`; `noun` is the singular lemma."""
    det: str
    noun: str
    plural: bool = False
    adjectives: tuple[str, ...] = ()
    prep: str | None = None
    prep_object: NounPhrase | None = None


@dataclasses.dataclass(frozen=True)
class Clause:
    """`subject [did/does/do not] verb [object] [adverb]`; `verb` is the base form."""
    subject: NounPhrase
    verb: str
    tense: str = "present"          # "present" | "past"
    obj: NounPhrase | None = None
    adverb: str | None = None
    negated: bool = False


@dataclasses.dataclass(frozen=True)
class Sentence:
    clauses: tuple[Clause, ...]
    conjunctions: tuple[str, ...] = ()   # one fewer than clauses


_NOUN_FORMS = dict((sg, (sg, pl)) for sg, pl in NOUNS)
_VERB_FORMS = dict((v[0], v) for v in TRANSITIVE_VERBS + INTRANSITIVE_VERBS)


def english(sentence: Sentence) -> str:
    """The source side."""
    words = []
    for i, clause in enumerate(sentence.clauses):
        if i:
            words.append(sentence.conjunctions[i - 1])
        words += _english_clause(clause)
    return " ".join(words + ["."])


def _english_np(np_: NounPhrase) -> list[str]:
    number = "pl" if np_.plural else "sg"
    words = [DETERMINERS[np_.det][number], *np_.adjectives, _NOUN_FORMS[np_.noun][np_.plural]]
    if np_.prep is not None:
        words += [np_.prep, *_english_np(np_.prep_object)]
    return words


def english_disagreeing(sentence: Sentence) -> str:
    """The source side with the first clause's verb in the other number than its subject's:
    "the dogs sees a cat .", "the dog do not see a cat ." (a past-tense verb is unchanged)."""
    words = []
    for i, clause in enumerate(sentence.clauses):
        if i:
            words.append(sentence.conjunctions[i - 1])
        words += _english_clause(clause, agree=i > 0)
    return " ".join(words + ["."])


def _english_clause(clause: Clause, agree: bool = True) -> list[str]:
    base, third, past = _VERB_FORMS[clause.verb]
    plural = clause.subject.plural == agree           # the verb's number
    if clause.negated:
        aux = "did" if clause.tense == "past" else ("do" if plural else "does")
        verb = [aux, "not", base]
    elif clause.tense == "past":
        verb = [past]
    else:
        verb = [base if plural else third]
    words = _english_np(clause.subject) + verb
    if clause.obj is not None:
        words += _english_np(clause.obj)
    if clause.adverb is not None:
        words.append(clause.adverb)
    return words


def target(sentence: Sentence) -> str:
    """The target side: postpositions, noun-adjective-determiner order, verb-final clauses."""
    words = []
    for i, clause in enumerate(sentence.clauses):
        if i:
            words.append(CONJUNCTIONS[sentence.conjunctions[i - 1]])
        words += _target_clause(clause)
    return " ".join(words + ["."])


def _target_np(np_: NounPhrase) -> list[str]:
    cls, number = noun_class(np_.noun), ("pl" if np_.plural else "sg")
    words = []
    if np_.prep is not None:
        words += _target_np(np_.prep_object) + [PREPOSITIONS[np_.prep]]
    words.append(STEMS[np_.noun] + NOUN_SUFFIX[cls, number])
    words += [STEMS[a] + ADJECTIVE_SUFFIX[cls, number] for a in np_.adjectives]
    words.append(DETERMINERS[np_.det][cls][np_.plural])
    return words


def _target_clause(clause: Clause) -> list[str]:
    number = "pl" if clause.subject.plural else "sg"
    verb = STEMS[_VERB_KEY[clause.verb]] + VERB_SUFFIX[clause.tense, number]
    words = _target_np(clause.subject)
    if clause.obj is not None:
        words += _target_np(clause.obj)
    if clause.adverb is not None:
        words.append(STEMS[clause.adverb] + "i")
    words.append(NEGATION_PREFIX + verb if clause.negated else verb)
    return words


# ---------------------------------------------------------------------------------------------
# Sampling.

class _Draw:
    """Choices from `random.Random(seed).random()` only (stable across Python versions)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def chance(self, p: float) -> bool:
        return self._rng.random() < p

    def pick(self, items):
        items = list(items)
        return items[min(int(self._rng.random() * len(items)), len(items) - 1)]


def _sample_np(draw: _Draw, allow_prep: bool) -> NounPhrase:
    plural = draw.chance(0.35)
    det = draw.pick(DETERMINERS)
    num_adjectives = 0 if draw.chance(0.5) else (1 if draw.chance(0.7) or not allow_prep else 2)
    adjectives: list[str] = []
    while len(adjectives) < num_adjectives:
        a = draw.pick(ADJECTIVES)
        if a not in adjectives:
            adjectives.append(a)
    prep = prep_object = None
    if allow_prep and draw.chance(0.15):
        prep = draw.pick(PREPOSITIONS)
        prep_object = _sample_np(draw, allow_prep=False)
    return NounPhrase(det, draw.pick(_NOUN_FORMS), plural, tuple(adjectives), prep, prep_object)


def _sample_clause(draw: _Draw) -> Clause:
    subject = _sample_np(draw, allow_prep=True)
    transitive = draw.chance(0.7)
    verb = draw.pick(v for v, _, _ in (TRANSITIVE_VERBS if transitive else INTRANSITIVE_VERBS))
    obj = _sample_np(draw, allow_prep=True) if transitive else None
    return Clause(subject, verb, "past" if draw.chance(0.5) else "present", obj,
                  draw.pick(ADVERBS) if draw.chance(0.25) else None, draw.chance(0.2))


def sample_sentence(draw: _Draw) -> Sentence:
    clauses = [_sample_clause(draw)]
    conjunctions = []
    if draw.chance(0.2):
        conjunctions.append(draw.pick(CONJUNCTIONS))
        clauses.append(_sample_clause(draw))
    return Sentence(tuple(clauses), tuple(conjunctions))


def _toy_translation_pair(draw: _Draw) -> tuple[str, str]:
    s = sample_sentence(draw)
    return english(s), target(s)


def sample_agreement_sentence(draw: _Draw) -> Sentence:
    """A sentence for `toy_classification`: its first clause is in the present tense (so its
    verb shows number) and its subject, without a prepositional phrase, shows its number,
    which is a fair coin. Sentences that do not qualify are drawn again."""
    while True:
        sentence = sample_sentence(draw)
        main = sentence.clauses[0]
        if main.tense != "present":
            continue
        subject = dataclasses.replace(main.subject, plural=draw.chance(0.5), prep=None,
                                      prep_object=None)
        other = dataclasses.replace(subject, plural=not subject.plural)
        if _english_np(subject) == _english_np(other):    # "the fish", "my sheep"
            continue
        return dataclasses.replace(
            sentence, clauses=(dataclasses.replace(main, subject=subject),
                               *sentence.clauses[1:]))


def _toy_classification_example(draw: _Draw) -> tuple[str, str]:
    sentence = sample_agreement_sentence(draw)
    if draw.chance(0.5):
        return english(sentence), "grammatical"
    return english_disagreeing(sentence), "ungrammatical"


def _copy_pair(draw: _Draw) -> tuple[str, str]:
    s = _symbols(draw, "abcdefghijklmnopqrstuvwxyz", 1, 20)
    return s, s


def _reverse_pair(draw: _Draw) -> tuple[str, str]:
    s = _symbols(draw, "abcdefghijklmnopqrstuvwxyz", 1, 20)
    return s, s[::-1]


def _sort_pair(draw: _Draw) -> tuple[str, str]:
    s = _symbols(draw, "abcdefghijklmnopqrstuvwxyz", 1, 20)
    return s, "".join(sorted(s))


def _addition_pair(draw: _Draw) -> tuple[str, str]:
    a = int(_symbols(draw, "0123456789", 1, 6))
    b = int(_symbols(draw, "0123456789", 1, 6))
    return f"{a}+{b}", str(a + b)


def _addition_preference(draw: _Draw) -> tuple[str, str, str]:
    """(prompt "a+b=", the sum, a near miss): the sum with one digit changed (never a
    leading zero), so the preference is checkable and the two responses differ little."""
    prompt, total = _addition_pair(draw)
    at = min(int(draw._rng.random() * len(total)), len(total) - 1)
    digits = [d for d in "0123456789" if d != total[at] and not (at == 0 and d == "0"
                                                                    and len(total) > 1)]
    wrong = total[:at] + draw.pick(digits) + total[at + 1:]
    return f"{prompt}=", total, wrong


def _symbols(draw: _Draw, alphabet: str, lo: int, hi: int) -> str:
    n = lo + min(int(draw._rng.random() * (hi - lo + 1)), hi - lo)
    return "".join(draw.pick(alphabet) for _ in range(n))


TASKS = {
    "toy_translation": _toy_translation_pair,
    "copy": _copy_pair,
    "reverse": _reverse_pair,
    "sort": _sort_pair,
    "addition": _addition_pair,
}

# (text, label) examples; the label names, in class order.
CLASSIFICATION_TASKS = {"toy_classification": _toy_classification_example}
# (prompt, chosen, rejected) examples: a checkable preference.
PREFERENCE_TASKS = {"addition_preference": _addition_preference}
# (prompt, answer) examples: a reward checks a completion against the answer.
PROMPT_TASKS = {"addition_prompts": lambda draw: _addition_preference(draw)[:2]}
CLASSIFICATION_LABELS = {"toy_classification": ("grammatical", "ungrammatical")}

SPLITS = ("train", "validation", "test")


def generate_splits(task: str, sizes: dict[str, int], seed: int = 0
                    ) -> dict[str, list[tuple[str, str]]]:
    """Disjoint splits of distinct pairs, drawn from one seeded stream.

    Pairs are drawn in order and a source already seen is skipped, so no source appears twice
    in a split or in two splits. Test and validation are filled first, so growing the training
    split never changes them. A task of `CLASSIFICATION_TASKS` gives (text, label) pairs, kept
    apart the same way by their text; one of `PREFERENCE_TASKS` (prompt, chosen, rejected)
    triples, by their prompt.

    Raises:
        UserError: if the task cannot produce that many distinct sources.
    """
    tasks = {**TASKS, **CLASSIFICATION_TASKS, **PREFERENCE_TASKS, **PROMPT_TASKS}
    if task not in tasks:
        raise UserError(f"unknown generated task {task!r}; available: {sorted(tasks)}")
    make, draw, seen = tasks[task], _Draw(seed), set()
    out: dict[str, list[tuple[str, str]]] = {}
    for split in ("test", "validation", "train"):
        pairs, misses = [], 0
        while len(pairs) < sizes[split]:
            example = make(draw)
            src = example[0]
            if src in seen:
                misses += 1
                if misses > 100 * sizes[split] + 10_000:
                    raise UserError(f"task {task!r} ran out of distinct examples at "
                                     f"{len(seen)}; asked for {sum(sizes.values())}")
                continue
            seen.add(src)
            pairs.append(example)
        out[split] = pairs
    return out


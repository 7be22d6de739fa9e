"""The prompts a chat target answers for its drafters' training data (treegen.train.chat_data), built offline
from templates and word lists: none is a benchmark prompt (tests/test_features.py checks).

Two mixes. `templates`: general explanations, code from the stdlib's training split's docstrings, a few
arithmetic forms and Python reference questions. `broad` (the default): those beside emails, notes and
descriptions, everyday advice, puzzles of several kinds and word problems of many forms, with varied
instructions on how to answer: a drafter trained on narrow templates drafts for them far better than for
other chat (docs/smollm2.md).
"""
from __future__ import annotations

import ast
import itertools
import random

TOPICS = ("photosynthesis", "the water cycle", "compound interest", "how vaccines work", "black holes",
          "the French Revolution", "machine learning", "recursion", "public key cryptography", "inflation",
          "plate tectonics", "the immune system", "how a bill becomes law", "supply and demand", "climate change",
          "the theory of evolution", "how the internet works", "gravity", "the stock market", "renewable energy",
          "the Roman Empire", "DNA", "sleep", "how airplanes fly", "blockchain", "the moon's phases",
          "version control with git", "databases", "the scientific method", "probability", "volcanoes",
          "electric cars", "the human heart", "time zones", "how a compiler works", "operating systems",
          "the printing press", "bees and pollination", "rainbows", "hash tables", "sorting algorithms",
          "unit testing", "HTTP", "the Pythagorean theorem", "prime numbers", "nutrition", "meditation")
THINGS = ("the ocean", "a rainy morning", "an old library", "a lost cat", "the first day of school", "autumn",
          "a mountain village", "a robot learning to paint", "a lighthouse keeper", "a city at night", "friendship",
          "a garden in spring", "a long train journey", "a snowstorm", "a market in summer", "a forgotten key",
          "a small bakery", "the desert at dawn", "a chess tournament", "a river", "a kite", "an empty stadium")
ACTIVITIES = ("learning a new language", "staying focused while studying", "running a first marathon",
              "saving money", "cooking for a family on a budget", "starting a vegetable garden", "job interviews",
              "public speaking", "writing clean code", "keeping a houseplant alive", "sleeping better",
              "travelling on a budget", "learning to draw", "working from home", "reading more books",
              "organising a small event", "moving to a new city", "learning Python", "debugging a program")
PAIRS = (("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"),
         ("TCP", "UDP"), ("renting", "buying a home"), ("RAM", "storage"), ("a simile", "a metaphor"),
         ("speed", "velocity"), ("a crocodile", "an alligator"), ("stocks", "bonds"), ("mitosis", "meiosis"),
         ("a compiler", "an interpreter"), ("SQL", "NoSQL databases"), ("tea", "coffee"), ("cats", "dogs as pets"),
         ("a process", "a thread"), ("the mean", "the median"), ("electric", "petrol cars"))
GENERAL = ("Explain {topic} in simple terms.", "Explain {topic} to a ten-year-old.",
           "What are the most important facts about {topic}?", "Give me a short summary of {topic}.",
           "Why does {topic} matter?", "Write a short paragraph about {topic} for a school newsletter.",
           "List five key ideas about {topic}.", "What is a common misconception about {topic}?",
           "Write a haiku about {thing}.", "Write a short poem about {thing}.",
           "Write a short story about {thing}.", "Describe {thing} in three sentences.",
           "Give me three tips for {activity}.", "How should a beginner approach {activity}?",
           "What are common mistakes in {activity}?", "Make a one-week plan for {activity}.",
           "What is the difference between {a} and {b}?", "Compare {a} and {b} in a short table.",
           "What are the pros and cons of {a} versus {b}?")
CODE = ("Write a Python function `{name}` that does the following: {doc}",
        "Implement `{name}` in Python. Its documentation says: {doc}",
        "How would I write a function in Python that does this? {doc}")
EXPLAIN = ("Explain what this Python code does:\n\n```python\n{src}\n```",
           "Review this function and suggest one improvement:\n\n```python\n{src}\n```",
           "Write a docstring for this function:\n\n```python\n{src}\n```")
REFERENCE = ("What does the Python documentation say about {topic}?", "Explain {topic} in Python with an example.")
NAMES = ("Sam", "Priya", "Lena", "Omar", "Jun", "Carlos", "Aisha", "Tom", "Mei", "Noah")
ITEMS = (("apples", 0.5), ("notebooks", 2.25), ("tickets", 12.0), ("pens", 1.2), ("books", 8.5), ("plants", 4.0))


def general_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        template = rng.choice(GENERAL)
        a, b = rng.choice(PAIRS)
        out.append(template.format(topic=rng.choice(TOPICS), thing=rng.choice(THINGS),
                                   activity=rng.choice(ACTIVITIES), a=a, b=b))
    return out


def math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        who, (item, price), k = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(3, 40)
        budget = round(price * k + rng.randint(1, 30), 2)
        out.append(rng.choice((
            (f"{who} buys {k} {item} at ${price:.2f} each and pays with ${budget:.2f}. How much change does "
             f"{who} get? Show your working."),
            f"If {k} {item} cost ${price * k:.2f}, how much do {k + rng.randint(2, 9)} {item} cost?",
            (f"{who} reads {k} pages a day. How many days does a "
             f"{k * rng.randint(5, 30) + rng.randint(0, k - 1)}-page book take? Explain."),
            f"What is {rng.randint(12, 99)} times {rng.randint(12, 99)}? Explain the steps.")))
    return out


def stdlib_functions(limit: int) -> list[tuple[str, str, str]]:
    """(name, first docstring paragraph, source) of short documented functions of the stdlib's training
    split, files read in a stable pseudo-random order until `limit` are found."""
    import hashlib

    from .corpus import stdlib_files

    files = sorted(stdlib_files("train"), key=lambda p: hashlib.sha1(p.name.encode()).hexdigest())
    found: list[tuple[str, str, str]] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") \
                    and node.end_lineno - node.lineno < 25:
                doc = ast.get_docstring(node)
                src = "\n".join(lines[node.lineno - 1:node.end_lineno])   # get_source_segment re-splits the file
                if doc and 60 < len(doc) and len(src) < 900:
                    found.append((node.name, doc.split("\n\n")[0].replace("\n", " "), src))
        if len(found) >= limit:
            break
    return found[:limit]


def code_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for name, doc, src in stdlib_functions(n):
        out.append(rng.choice(EXPLAIN).format(src=src) if rng.random() < 0.4 else
                   rng.choice(CODE).format(name=name, doc=doc))
    return out


def reference_prompts(rng: random.Random, n: int) -> list[str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    return [rng.choice(REFERENCE).format(topic=f"`{rng.choice(names)}`") for _ in range(n)]


# -- the broad mix's families --------------------------------------------------------------------------------

STEPS = ("", " Show your working.", " Explain your steps.", " Think step by step.",
         " Explain each step, then give the final answer on its own line.", " Keep the answer short.")
RECIPIENTS = ("your manager", "a teacher", "your landlord", "a colleague", "a customer", "an old friend",
              "the local council", "a hotel", "your sports club", "a new team member", "a supplier", "your aunt")
PURPOSES = ("asking for a day off next Friday", "about a heater that stopped working",
            "thanking them for their help with a project", "to move a meeting to next week",
            "about an order that arrived damaged", "inviting them to a small farewell party",
            "apologising for missing a deadline", "asking for a letter of reference",
            "asking for a refund for a cancelled booking", "to introduce yourself",
            "suggesting a new time for the weekly call", "asking to borrow a ladder for the weekend")
TONES = ("short, friendly", "polite", "formal", "brief and clear", "warm")
KINDS = ("product description", "short advert", "social media post", "two-sentence slogan", "short welcome speech",
         "notice for a community board")
SUBJECTS = ("a reusable water bottle", "a neighbourhood cleanup day", "a new coffee shop", "a second-hand bicycle",
            "a school science fair", "a hiking backpack", "a community garden", "a charity book sale",
            "a beginners' yoga class", "a repair cafe", "a local farmers' cooperative", "a summer reading club")
PLACES = ("a fishing harbour at dawn", "a crowded food market", "a quiet forest after rain",
          "a kitchen before a holiday dinner", "a library during exam week", "a beach in winter",
          "a small town on market day", "a carpenter's workshop", "an airport late at night",
          "a hospital waiting room", "a mountain hut in a storm", "a school playground at lunchtime", "a night bus",
          "a greenhouse in July")
ANGLES = ("", " Focus on the sounds.", " Use vivid details.", " Write it for a travel guide.",
          " Keep it under 80 words.", " Describe the light and the smells.")
OPENINGS = ("The letter had no return address.", "Nobody expected the old clock to start ticking again.",
            "It was the last bus of the night.", "The map was missing one corner.",
            "She found the key inside a loaf of bread.", "The robot asked for a day off.",
            "On the first warm day of spring, the lake was still frozen.", "He had never seen the sea.")
STYLES = ("more polite", "more formal", "simpler", "more persuasive", "more concise", "friendlier")
SENTENCES = ("send me the file now", "the meeting is cancelled because nobody prepared",
             "your order will be late again", "we need more money for the project",
             "I can't come to your party", "the printer is broken, fix it", "this report has many mistakes")
TASKS = ("remove a coffee stain from a shirt", "prepare for a job interview", "plan a birthday party on a budget",
         "start running as a beginner", "keep bread fresh for longer", "write a good CV", "make a weekly meal plan",
         "learn to touch type", "fall asleep faster", "negotiate a salary", "take better phone photos",
         "organise a small kitchen", "study for a maths exam", "care for a new puppy", "reduce food waste at home")
TRIPS = ("a weekend camping trip", "a week in a big city", "a business trip of three days", "a beach holiday",
         "a winter hiking day", "a long flight")
DISHES = ("lentil soup", "vegetable curry", "pancakes", "tomato pasta", "fried rice", "banana bread", "a green salad",
          "omelette", "chili", "oat cookies")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
GROUPS = (("cats", "animals", "pets"), ("roses", "flowers", "red things"), ("doctors", "graduates", "runners"),
          ("squares", "rectangles", "large shapes"), ("pilots", "employees", "musicians"))
RELATIONS = ("arrived before", "scored more points than", "finished the race ahead of", "is older than",
             "read more books than")
FOODS = (("flour", "grams"), ("milk", "millilitres"), ("rice", "grams"), ("sugar", "grams"), ("butter", "grams"))


WRITING = ("Write a {tone} email to {recipient} {purpose}.", "Write a {kind} for {subject}.",
           "Describe {place} in one paragraph.{angle}", "Write a very short story that begins with: \"{opening}\"",
           "Rewrite this to sound {style}: \"{sentence}\"", "Write a thank-you note to {recipient} for {gift}.")
ADVICE = ("How do I {task}?", "Give me {few} tips to {task}.", "What should I pack for {trip}?",
          "Give me a simple recipe for {dish}.", "I want to {task}. Where should I start?")
PUZZLES = ("{facts} {ask}", "What number comes next: {sequence}? Explain the pattern.",
           "All {a} are {b}. Some {b} are {c}. Can we conclude that some {a} are {c}? Explain.",
           "If today is {day}, what day of the week will it be in {days} days?",
           "{people} people each shake hands with everyone else once. How many handshakes are there?",
           "What is the angle between the hands of a clock at {hour}:{minute}?",
           ("You have {coins} coins that look the same; one is heavier. What is the fewest number of weighings on "
           "a balance scale that always finds it?"),
           "{n1} is {n2}'s mother. {n3} is {n1}'s brother. What is {n3} to {n2}?",
           ("A box has {red} red and {blue} blue balls. If you take two without looking, what is the chance both "
           "are red?"))
PROBLEMS = ("A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price?",
            "A recipe for {few} people uses {grams} {unit} of {food}. How much {food} is needed for {more} people?",
            "A room is {w} m by {h} m. Carpet costs ${cost} per square metre. How much does carpet for the room cost?",
            "{n1}'s test scores are {scores}. What is the average score?",
            "A cyclist rides {km} km in {hours} hours. What is her average speed?",
            "{few} friends share a restaurant bill of ${bill} and add a {tip}% tip. How much does each person pay?",
            "A town grew from {small} to {large} people. What is the percentage increase?",
            ("A car uses {litres} litres of fuel per 100 km. How much fuel does a {trip_km} km trip need, and what "
            "does it cost at ${fuel} per litre?"),
            "{n1} is {w} years older than {n2}. In {h} years their ages will add up to {total}. How old is {n2} now?",
            "{n1} earns ${wage} an hour and works {hours_week} hours a week. How much is that in {weeks} weeks?",
            "How much interest does ${principal} earn at {rate}% simple interest in {w} years?",
            "How many minutes are there in {w} days?",
            "A rectangle has a perimeter of {perimeter} cm and one side of {w} cm. What is its area?",
            "A tank holds {tank} litres and fills at {flow} litres a minute. How long does it take to fill from empty?")


def ordering(rng: random.Random) -> tuple[str, str]:
    """A chain of one relation between 4-5 people, and a question on it."""
    people = rng.sample(NAMES, rng.randint(4, 5))
    relation = rng.choice(RELATIONS)
    facts = " ".join(f"{a} {relation} {b}." for a, b in itertools.pairwise(people))
    ask = rng.choice(("Who comes last?", "Who is in the middle?", f"Is {people[0]} ahead of {people[-1]}?",
                      "Put them in order."))
    return facts, ask


def sequence(rng: random.Random) -> str:
    a, d = rng.randint(1, 20), rng.randint(2, 9)
    terms = rng.choice(([a + d * i for i in range(5)], [a * 2 ** i for i in range(5)],
                        [i * i + a for i in range(1, 6)], [a + (d if i % 2 else -1) * i for i in range(6)]))
    return ", ".join(map(str, terms))


def fields(rng: random.Random) -> dict:
    """Every field the broad families' templates name, drawn afresh (a template uses a few of them)."""
    n1, n2, n3 = rng.sample(NAMES, 3)
    food, unit = rng.choice(FOODS)
    a, b, c = rng.choice(GROUPS)
    facts, ask = ordering(rng)
    few = rng.randint(3, 7)
    scores = ", ".join(str(rng.randint(55, 100)) for _ in range(rng.randint(4, 6)))
    return {
        "tone": rng.choice(TONES), "recipient": rng.choice(RECIPIENTS), "purpose": rng.choice(PURPOSES),
        "kind": rng.choice(KINDS), "subject": rng.choice(SUBJECTS), "place": rng.choice(PLACES),
        "angle": rng.choice(ANGLES), "opening": rng.choice(OPENINGS), "style": rng.choice(STYLES),
        "sentence": rng.choice(SENTENCES),
        "gift": rng.choice(("a birthday gift", "a great dinner", "their advice", "their help with a project")),
        "task": rng.choice(TASKS), "few": few, "more": few + rng.randint(3, 9), "trip": rng.choice(TRIPS),
        "dish": rng.choice(DISHES), "facts": facts, "ask": ask, "sequence": sequence(rng), "a": a, "b": b, "c": c,
        "day": rng.choice(DAYS), "days": rng.randint(10, 200), "people": rng.randint(5, 30),
        "hour": rng.randint(1, 12), "minute": rng.choice(("00", "15", "20", "30", "45")),
        "coins": rng.choice((8, 9, 12, 27)), "n1": n1, "n2": n2, "n3": n3, "red": rng.randint(2, 9),
        "blue": rng.randint(2, 9), "price": rng.randint(30, 200), "pct": rng.choice((10, 15, 20, 25, 30, 40)),
        "grams": rng.randint(2, 9) * 50, "unit": unit, "food": food, "w": rng.randint(2, 9),
        "h": rng.randint(2, 10), "cost": rng.randint(8, 40), "scores": scores, "km": rng.randint(12, 90),
        "hours": rng.choice((1.5, 2, 2.5, 3, 4)), "bill": rng.randint(60, 300),
        "tip": rng.choice((10, 12, 15, 18, 20)), "small": rng.randint(10, 50) * 1000,
        "large": rng.randint(51, 90) * 1000, "litres": rng.choice((5, 6, 6.5, 7, 8)),
        "trip_km": rng.randint(120, 900), "fuel": rng.choice((1.5, 1.7, 1.9)), "total": rng.randint(30, 90),
        "wage": rng.randint(12, 40), "hours_week": rng.randint(10, 40), "weeks": rng.randint(3, 12),
        "principal": rng.randint(5, 50) * 100, "rate": rng.choice((2, 3, 4, 5, 6)),
        "perimeter": rng.randint(10, 40) * 2, "tank": rng.randint(100, 900), "flow": rng.randint(5, 30)}


def family(templates: tuple[str, ...], endings: tuple[str, ...] = ("",)):
    """n prompts from these templates, each with one of `endings` (how to answer)."""
    def prompts(rng: random.Random, n: int) -> list[str]:
        return [rng.choice(templates).format(**fields(rng)) + rng.choice(endings) for _ in range(n)]
    return prompts


writing_prompts, advice_prompts = family(WRITING), family(ADVICE)
reasoning_prompts, word_problems = family(PUZZLES, STEPS[:3]), family(PROBLEMS, STEPS)

# each mix: its families in the order they draw from one random stream (a seed's prompts depend on it), and
# their shares of the prompts
MIXES = {"broad": ((general_prompts, 0.2), (advice_prompts, 0.1), (writing_prompts, 0.2), (reasoning_prompts, 0.15),
                   (word_problems, 0.1), (math_prompts, 0.05), (code_prompts, 0.15), (reference_prompts, 0.05)),
         "templates": ((general_prompts, 0.4), (code_prompts, 0.35), (math_prompts, 0.15), (reference_prompts, 0.1))}
DEFAULT_MIX = "broad"


def build_prompts(total: int, seed: int = 0, mix: str = DEFAULT_MIX) -> list[str]:
    """`total` distinct prompts (fewer if the templates run out), drawn from `mix`."""
    for scale in (1.0, 1.5, 2.0, 3.0):
        prompts = prompt_mix(int(total * scale), seed, mix)
        if len(prompts) >= total:
            break
    return prompts[:total]


def prompt_mix(total: int, seed: int, mix: str = DEFAULT_MIX) -> list[str]:
    """About `total` prompts of the mix's families in their shares (MIXES), shuffled, repeats dropped."""
    if mix not in MIXES:
        raise ValueError(f"unknown prompt mix {mix!r}: one of {', '.join(MIXES)}")
    rng = random.Random(seed)
    prompts = [p for make, share in MIXES[mix] for p in make(rng, int(total * share))]
    prompts = list(dict.fromkeys(prompts))   # templated prompts can repeat
    rng.shuffle(prompts)
    return prompts

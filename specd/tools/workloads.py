"""Deterministic prompt sets for `specd bench`; today the repetitive one (specd/prompts/repetitive.jsonl).

Agentic traffic repeats its structure from request to request: the same
tool schema, the same database, the same kind of edit, with different
values. A drafter that learns across requests (`--draft suffix`) pays there,
and the bench shows it learning when the requests run in sequence. Three
categories, interleaved by the bench's round-robin selection:

- tool: one JSON tool call against a fixed set of tools;
- sql: one query over a fixed schema;
- review: the same code-review edit of similar functions.

Regenerate the shipped file (the test suite checks it is up to date):

    python -m specd.tools.workloads --out specd/prompts/repetitive.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

REPETITIVE_FILE = Path(__file__).resolve().parents[1] / "prompts" / "repetitive.jsonl"
PER_CATEGORY = 40
SEED = 2411  # fixed: the shipped file is this seed's output

CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens"]
PEOPLE = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
TOPICS = ["the quarterly report", "the team offsite", "the budget review", "the release plan", "the hiring plan"]

TOOLS = """\
- get_weather(city: string, unit: "celsius" | "fahrenheit")
- book_flight(origin: string, destination: string, date: "YYYY-MM-DD", passengers: integer)
- send_email(to: string, subject: string, body: string)
- create_event(title: string, date: "YYYY-MM-DD", start_time: "HH:MM", duration_minutes: integer)"""

TOOL_PREAMBLE = (
    "You are an assistant that acts only by calling tools. Available tools:\n"
    f"{TOOLS}\n\n"
    'Reply with exactly one JSON object of the form {"tool": "NAME", "arguments": {...}} and nothing else.\n\n'
    "Example request: What is the weather in Oslo, in fahrenheit?\n"
    'Example reply: {"tool": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}\n\n'
    "Request: "
)

SCHEMA = """\
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, signup_date DATE);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                     amount REAL, status TEXT, created_at DATE);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), product_id INTEGER REFERENCES products(id),
                          quantity INTEGER);"""

SQL_PREAMBLE = (
    f"Database schema:\n\n{SCHEMA}\n\nWrite one SQL query (SQLite) that answers the question below. "
    "Reply with the query in a ```sql block and nothing else.\n\nQuestion: "
)

REVIEW_PREAMBLE = (
    "Review this Python function. Add type hints and a one-line docstring, replace the bare `except:` "
    "with `except (KeyError, ValueError):`, and keep the behaviour. Reply with the complete corrected "
    "function in a ```python block.\n\n"
)

FIELDS = ["age", "height", "weight", "score", "count", "price", "level", "rank", "year", "quantity"]
SOURCES = ["row", "record", "payload", "item", "entry"]


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _tool_request(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        unit = rng.choice(["celsius", "fahrenheit"])
        return f"What is the weather in {rng.choice(CITIES)} right now, in {unit}?"
    if kind == 1:
        a, b = rng.sample(CITIES, 2)
        n = rng.randint(1, 4)
        return f"Book a flight from {a} to {b} on {_date(rng)} for {n} passenger{'s' if n > 1 else ''}."
    if kind == 2:
        who, topic = rng.choice(PEOPLE), rng.choice(TOPICS)
        return f"Email {who}@example.com with the subject '{topic.capitalize()}' asking for comments on {topic}."
    return (
        f"Schedule a meeting about {rng.choice(TOPICS)} on {_date(rng)} at {rng.randint(8, 17):02d}:00 "
        f"for {rng.choice([30, 45, 60, 90])} minutes."
    )


def _sql_question(rng: random.Random) -> str:
    kind = rng.randrange(5)
    city, year = rng.choice(CITIES), rng.choice([2023, 2024, 2025])
    if kind == 0:
        return f"Which customers from {city} placed orders with an amount over {rng.choice([50, 100, 250])} in {year}?"
    if kind == 1:
        return f"What is the total amount of orders with status '{rng.choice(['shipped', 'pending', 'cancelled'])}' per city?"
    if kind == 2:
        return f"List the {rng.choice([3, 5, 10])} products of category '{rng.choice(['books', 'toys', 'garden'])}' sold in the largest quantity."
    if kind == 3:
        return f"How many customers from {city} signed up in {year} and have never placed an order?"
    return f"What is the average order amount per customer in {city}, highest first?"


def _review_function(rng: random.Random) -> str:
    field, source = rng.choice(FIELDS), rng.choice(SOURCES)
    default = rng.choice(["0", "None", "-1"])
    scale = rng.choice(["", " * 2", " + 1", " // 10"])
    name = f"read_{field}"
    return (
        f"```python\ndef {name}({source}):\n"
        f"    try:\n"
        f'        value = int({source}["{field}"]){scale}\n'
        f"    except:\n"
        f"        value = {default}\n"
        f"    return value\n```"
    )


def repetitive_prompts(per_category: int = PER_CATEGORY, seed: int = SEED) -> list[dict[str, str]]:
    """The repetitive prompt set: per_category prompts of each category, in a fixed order."""
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    makers = [
        ("tool", lambda: TOOL_PREAMBLE + _tool_request(rng)),
        ("sql", lambda: SQL_PREAMBLE + _sql_question(rng)),
        ("review", lambda: REVIEW_PREAMBLE + _review_function(rng)),
    ]
    for category, make in makers:
        seen: set[str] = set()
        while len(seen) < per_category:
            prompt = make()
            if prompt in seen:
                continue  # every request distinct: a repeat would be answered from memory, not learnt
            seen.add(prompt)
            out.append({"id": f"{category}-{len(seen):02d}", "category": category, "format": "chat", "prompt": prompt})
    return out


def to_jsonl(prompts: Sequence[dict[str, str]]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the repetitive prompt set (deterministic).")
    parser.add_argument("--out", default=str(REPETITIVE_FILE), help="JSONL file (default: the shipped one)")
    parser.add_argument("--per-category", type=int, default=PER_CATEGORY)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    Path(args.out).write_text(to_jsonl(repetitive_prompts(args.per_category, args.seed)), encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

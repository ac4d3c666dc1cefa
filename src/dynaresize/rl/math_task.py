"""The built-in math task `arith`: grade-school arithmetic word problems, offline.

Problems are generated in code from a fixed seed (the same list in every process and on every
machine), one of seven templates each (add and take away, groups of, sharing equally, change
from a bill, a rate over days, packs plus a few, a fraction of a whole), with an exact answer
(an integer, or a fraction in lowest terms). They are written once into verl's parquet schema
(`dataset_file`: a cached file, named by the generator's version, count and seed), and the
task reads that file like any user's dataset, so the built-in task runs verl's data path:

    {"data_source": "dynaresize/arith", "prompt": [{"role": "user", "content": QUESTION + INSTRUCTION}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "14"},
     "extra_info": {"split": "train", "index": 0, "question": ..., "answer": "14"}}

The grader `compute_score` is a verl-style reward (run in the reward pool, `rl.reward_pool`):
math-verify compares the response's answer with the ground truth, the answer being the text
after the last `####` when there is one (GSM8K's format), else whatever math-verify extracts
(`\\boxed{...}`, a plain number, a fraction `3/4` or `\\frac{3}{4}`, a decimal). It returns
`{"score": 1.0 or 0.0, "answered": 1.0 or 0.0}` ("answered": an answer was found at all).
math-verify's own timeouts use `signal.alarm`, which only works in a process's main thread:
they are off here (`parsing_timeout=None`, `timeout_seconds=None`); the reward pool enforces
`task.reward_timeout_s` instead. Importing this module imports neither math-verify nor pyarrow.
"""

from __future__ import annotations

import os
import random
from fractions import Fraction
from pathlib import Path

DATA_SOURCE = "dynaresize/arith"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's GSM8K suffix
NUM_PROBLEMS = 512
SEED = 2024  # part of the task, not of a run
VERSION = 1  # of the generator: a change of templates makes a new cache file

_NAMES = ("Ali", "Ben", "Chen", "Dana", "Eva", "Farid", "Grace", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mia", "Noor")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells")


def _problem(rng: random.Random) -> tuple[str, Fraction]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(5, 60), rng.randint(2, 30)
        c = rng.randint(1, a + b)
        return (f"{name} has {a} {item}. {name} gets {b} more and gives {c} to a friend. "
                f"How many {item} does {name} have now?", Fraction(a + b - c))
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", Fraction(a * b)
    if kind == 2:
        each, friends = rng.randint(2, 15), rng.randint(2, 9)
        return (f"{name} shares {each * friends} {item} equally among {friends} friends. "
                f"How many {item} does each friend get?", Fraction(each))
    if kind == 3:
        price, count = rng.randint(2, 15), rng.randint(2, 6)
        bill = next(b for b in (20, 50, 100) if b >= price * count)
        return (f"A notebook costs {price} dollars. {name} buys {count} notebooks and pays with a {bill} dollar "
                f"bill. How many dollars of change does {name} get?", Fraction(bill - price * count))
    if kind == 4:
        pages, days = rng.randint(5, 40), rng.randint(2, 14)
        return (f"{name} reads {pages} pages every day. How many pages does {name} read in {days} days?",
                Fraction(pages * days))
    if kind == 5:
        packs, per, extra = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 20)
        return (f"{name} buys {packs} packs of {item} with {per} in each pack and already has {extra}. "
                f"How many {item} does {name} have in all?", Fraction(packs * per + extra))
    slices = rng.choice((4, 6, 8, 10, 12))
    eaten = rng.randint(1, slices - 1)
    return (f"A pizza is cut into {slices} equal slices. {name} eats {eaten} of them. "
            f"What fraction of the pizza does {name} eat?", Fraction(eaten, slices))


def answer_text(value: Fraction) -> str:
    """An exact answer as text: `14`, or `3/4` in lowest terms."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def problems(num: int = NUM_PROBLEMS, seed: int = SEED, split: str = "train") -> list[dict]:
    """`num` problems as rows of verl's schema (see the module docstring); distinct questions."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < num:
        question, value = _problem(rng)
        if question in seen:
            continue
        seen.add(question)
        answer = answer_text(value)
        rows.append({"data_source": DATA_SOURCE,
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": split, "index": len(rows), "question": question, "answer": answer}})
    return rows


def cache_dir() -> Path:
    """Where generated datasets go: $DYNARESIZE_CACHE, else $XDG_CACHE_HOME/dynaresize, else ~/.cache/dynaresize."""
    if os.environ.get("DYNARESIZE_CACHE"):
        return Path(os.environ["DYNARESIZE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynaresize"


def dataset_file(num: int = NUM_PROBLEMS, seed: int = SEED) -> Path:
    """The task's parquet file, written on first use (atomically; the same bytes every time)."""
    from dynaresize.rl.dataset import write_parquet

    path = cache_dir() / f"arith-v{VERSION}-{num}-{seed}.parquet"
    if not path.is_file():
        write_parquet(problems(num, seed), path)
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl-style grader (see the module docstring): {"score": 1.0 if the answer equals
    `ground_truth`, else 0.0, "answered": 1.0 if an answer was found}."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" is by design here
    text = str(solution_str)
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
        text = text.splitlines()[0] if text else ""
    text = text[-1000:]  # the answer is at the end; bounds the parser's work on a long response
    gold = parse(str(ground_truth), parsing_timeout=None)
    pred = parse(text, parsing_timeout=None) if text.strip() else []
    if not pred:
        return {"score": 0.0, "answered": 0.0}
    return {"score": float(bool(verify(gold, pred, timeout_seconds=None))), "answered": 1.0}

"""Grade-school word problems with worked answers, from templates written for recurfit (`embedded:math`).

Each template draws its names, objects and numbers from a seeded generator and writes the solution step by
step, every step a sentence with its arithmetic, in the layout the GSM8K chain-of-thought prompt uses. The
templates were written for this module, not taken from any benchmark, and every problem passes through
`data prepare`'s decontamination like any other document; docs/results/README.md (the errata note) gives the
overlap check's numbers.

Held-out problems (`held_out_problems`, the demo's math accuracy) come from another seed and draw every number
above the range the training problems draw it from, so none can equal a training problem: the `easy` split from
the training templates, the `hard` split from templates of four steps, more than any training problem has.
`read_solution` reads a model's answer in that layout: whether it states an answer, and how many of its
arithmetic steps are true.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Esi", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kemal", "Lucia")
NAMES += ("Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Soren", "Tomas", "Ulla", "Viktor", "Wren", "Yusuf")
GOODS = (("pencil", "pencils"), ("notebook", "notebooks"), ("jar of honey", "jars of honey"), ("kite", "kites"))
GOODS += (("loaf of rye bread", "loaves of rye bread"), ("pot of basil", "pots of basil"), ("lantern", "lanterns"))
CROPS = ("pears", "plums", "walnuts", "turnips", "radishes", "apricots", "chestnuts", "quinces")
VESSELS = ("crates", "baskets", "sacks", "boxes", "barrels")


def _shop(rng: random.Random) -> tuple[str, list[str], int]:
    name, (one, many) = rng.choice(NAMES), rng.choice(GOODS)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    cost = count * price
    paid = (cost // 10 + rng.randint(1, 5)) * 10
    question = (
        f"At the village market a {one} sells for ${price}. {name} picks out {count} {many} and hands the "
        f"stall keeper ${paid}. How many dollars of change does {name} get back?"
    )
    steps = [f"The {many} cost {count} * ${price} = ${cost}.", f"The change is ${paid} - ${cost} = ${paid - cost}."]
    return question, steps, paid - cost


def _harvest(rng: random.Random) -> tuple[str, list[str], int]:
    name, crop, vessel = rng.choice(NAMES), rng.choice(CROPS), rng.choice(VESSELS)
    vessels, each, eaten = rng.randint(3, 12), rng.randint(6, 30), rng.randint(2, 20)
    total = vessels * each
    question = (
        f"{name} fills {vessels} {vessel} with {crop}, putting {each} {crop} in each. On the way home "
        f"{eaten} of them are eaten by a goat that slipped through the fence. How many {crop} reach home?"
    )
    steps = [
        f"The {vessel} hold {vessels} * {each} = {total} {crop}.",
        f"{total} - {eaten} = {total - eaten} are left.",
    ]
    return question, steps, total - eaten


def _cycling(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    speed, hours, rest = rng.randint(8, 24), rng.randint(2, 6), rng.randint(1, 3)
    first, second = speed * hours, speed * rest
    question = (
        f"{name} rides a bicycle at a steady {speed} kilometres per hour. After riding for {hours} hours "
        f"{name} stops for lunch, then rides {rest} more hours at the same pace. How many kilometres is that "
        "in all?"
    )
    steps = [
        f"Before lunch: {speed} * {hours} = {first} km.",
        f"After lunch: {speed} * {rest} = {second} km.",
        f"In all: {first} + {second} = {first + second} km.",
    ]
    return question, steps, first + second


def _sharing(rng: random.Random) -> tuple[str, list[str], int]:
    name, friends = rng.choice(NAMES), rng.randint(2, 8)
    each, kept = rng.randint(3, 15), rng.randint(1, 9)
    total = friends * each + kept
    question = (
        f"{name} baked {total} oat biscuits for a picnic, kept {kept} for later and shared the rest equally "
        f"among {friends} friends. How many biscuits did each friend receive?"
    )
    steps = [f"{total} - {kept} = {total - kept} biscuits were shared.", f"{total - kept} / {friends} = {each} each."]
    return question, steps, each


def _savings(rng: random.Random) -> tuple[str, list[str], int]:
    name, (one, _) = rng.choice(NAMES), rng.choice(GOODS)
    weekly, weeks, start = rng.randint(3, 20), rng.randint(3, 12), rng.randint(1, 40)
    saved = weekly * weeks
    question = (
        f"{name} has ${start} in a tin and adds ${weekly} to it every week. How many dollars are in the tin "
        f"after {weeks} weeks, if nothing is taken out to buy a {one}?"
    )
    steps = [
        f"{weeks} weeks of ${weekly} make {weeks} * ${weekly} = ${saved}.",
        f"${start} + ${saved} = ${start + saved}.",
    ]
    return question, steps, start + saved


def _fence(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    length, width, post = rng.randint(5, 40), rng.randint(3, 25), rng.randint(2, 6)
    perimeter = 2 * (length + width)
    question = (
        f"{name} is fencing a rectangular vegetable plot {length} metres long and {width} metres wide, and "
        f"sets a fence post every {post} metres around it. How many metres of fencing are needed?"
    )
    steps = [f"The perimeter is 2 * ({length} + {width}) = 2 * {length + width} = {perimeter} metres."]
    return question, steps, perimeter


def _percent(rng: random.Random) -> tuple[str, list[str], int]:
    name, (one, _) = rng.choice(NAMES), rng.choice(GOODS)
    price, off = rng.randint(1, 15) * 20, rng.choice((10, 20, 25, 30, 40, 50))  # whole-dollar discounts
    discount = price * off // 100
    question = (
        f"A workshop sells a hand-made {one} for ${price}. During the autumn fair everything is {off}% off. "
        f"What does {name} pay for one at the fair?"
    )
    steps = [
        f"The discount is {off}% of ${price} = ${discount}.",
        f"{name} pays ${price} - ${discount} = ${price - discount}.",
    ]
    return question, steps, price - discount


def _ages(rng: random.Random) -> tuple[str, list[str], int]:
    older, younger = rng.sample(NAMES, 2)
    age, gap, years = rng.randint(4, 15), rng.randint(2, 30), rng.randint(2, 10)
    question = (
        f"{younger} is {age} years old and {older} is {gap} years older. How old will {older} be in {years} "
        "years' time?"
    )
    steps = [
        f"{older} is {age} + {gap} = {age + gap} now.",
        f"In {years} years: {age + gap} + {years} = {age + gap + years}.",
    ]
    return question, steps, age + gap + years


def _market_trip(rng: random.Random) -> tuple[str, list[str], int]:
    name, (one, many), (other, others) = rng.choice(NAMES), *rng.sample(GOODS, 2)
    count, price, more, cost = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(2, 15)
    first, second = count * price, more * cost
    paid = ((first + second) // 10 + rng.randint(1, 5)) * 10
    question = (
        f"At the village market a {one} sells for ${price} and a {other} for ${cost}. {name} buys {count} "
        f"{many} and {more} {others} and hands over ${paid}. How many dollars of change does {name} get back?"
    )
    steps = [
        f"The {many} cost {count} * ${price} = ${first}.",
        f"The {others} cost {more} * ${cost} = ${second}.",
        f"Together they cost ${first} + ${second} = ${first + second}.",
        f"The change is ${paid} - ${first + second} = ${paid - first - second}.",
    ]
    return question, steps, paid - first - second


def _two_harvests(rng: random.Random) -> tuple[str, list[str], int]:
    name, crop, (vessel, other) = rng.choice(NAMES), rng.choice(CROPS), rng.sample(VESSELS, 2)
    vessels, each, more, each_more = rng.randint(3, 12), rng.randint(6, 30), rng.randint(3, 12), rng.randint(6, 30)
    first, second = vessels * each, more * each_more
    eaten = rng.randint(2, 20)
    question = (
        f"{name} fills {vessels} {vessel} with {each} {crop} each and {more} {other} with {each_more} {crop} each. "
        f"A goat eats {eaten} of them on the way home. How many {crop} reach home?"
    )
    steps = [
        f"The {vessel} hold {vessels} * {each} = {first} {crop}.",
        f"The {other} hold {more} * {each_more} = {second} {crop}.",
        f"In all {first} + {second} = {first + second} {crop}.",
        f"{first + second} - {eaten} = {first + second - eaten} reach home.",
    ]
    return question, steps, first + second - eaten


def _savings_spent(rng: random.Random) -> tuple[str, list[str], int]:
    name, (_, many) = rng.choice(NAMES), rng.choice(GOODS)
    weekly, weeks, start = rng.randint(3, 20), rng.randint(3, 12), rng.randint(1, 40)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    saved, cost = weekly * weeks, count * price
    start += max(0, cost - start - saved)  # never more spent than saved
    question = (
        f"{name} has ${start} in a tin and adds ${weekly} every week for {weeks} weeks, then buys {count} "
        f"{many} at ${price} each. How many dollars are left in the tin?"
    )
    steps = [
        f"{weeks} weeks of ${weekly} make {weeks} * ${weekly} = ${saved}.",
        f"The tin holds ${start} + ${saved} = ${start + saved}.",
        f"The {many} cost {count} * ${price} = ${cost}.",
        f"${start + saved} - ${cost} = ${start + saved - cost} are left.",
    ]
    return question, steps, start + saved - cost


def _three_legs(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    speed, hours, rest, walk = rng.randint(8, 24), rng.randint(2, 6), rng.randint(1, 3), rng.randint(2, 6)
    pace = rng.randint(2, 6)
    first, second, third = speed * hours, speed * rest, pace * walk
    question = (
        f"{name} rides a bicycle at {speed} kilometres per hour for {hours} hours, stops for lunch, rides {rest} "
        f"more hours at the same pace, then walks for {walk} hours at {pace} kilometres per hour. How many "
        "kilometres is that in all?"
    )
    steps = [
        f"Before lunch: {speed} * {hours} = {first} km.",
        f"After lunch: {speed} * {rest} = {second} km.",
        f"Walking: {pace} * {walk} = {third} km.",
        f"In all: {first} + {second} + {third} = {first + second + third} km.",
    ]
    return question, steps, first + second + third


TEMPLATES: tuple[Callable[[random.Random], tuple[str, list[str], int]], ...] = (
    _shop,
    _harvest,
    _cycling,
    _sharing,
    _savings,
    _fence,
    _percent,
    _ages,
)
# Four steps each: more than any of TEMPLATES (at most three), for the held-out `hard` split.
HARD_TEMPLATES: tuple[Callable[[random.Random], tuple[str, list[str], int]], ...] = (
    _market_trip,
    _two_harvests,
    _savings_spent,
    _three_legs,
)
SPLITS = {"easy": TEMPLATES, "hard": HARD_TEMPLATES}


def word_problems(count: int, seed: int = 0) -> Iterator[tuple[str, str, str]]:
    """`count` problems as (question, worked steps, answer), the same for the same seed."""
    yield from _problems(random.Random(f"recurfit word problems {seed}"), TEMPLATES, count)


def held_out_problems(count: int, split: str = "easy", seed: int = 0) -> Iterator[tuple[str, str, str]]:
    """`count` problems no training problem can equal, as (question, worked steps, answer): another seed, and
    every number drawn above its training range. `split`: "easy" (the training templates) or "hard" (four steps)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, not {split!r}.")
    yield from _problems(_AboveTrainingRanges(f"recurfit held-out word problems {split} {seed}"), SPLITS[split], count)


def _problems(rng: random.Random, templates, count: int) -> Iterator[tuple[str, str, str]]:
    for _ in range(count):
        question, steps, answer = rng.choice(templates)(rng)
        yield question, " ".join(steps), str(answer)


class _AboveTrainingRanges(random.Random):
    """A generator whose `randint(a, b)`, the templates' only way to draw a number, draws above the range instead:
    from b + 1 to b + half its width (at least two values), so the numbers stay of the training problems' size."""

    def randint(self, a: int, b: int) -> int:
        return super().randint(b + 1, b + max(2, (b - a + 1) // 2))


class Solution(NamedTuple):
    """What a worked answer holds: the number its "The answer is N." states (None: it states none), its arithmetic
    steps (equations with an operation, "a * b = c") and how many of them are true."""

    stated: str | None
    steps: int
    steps_right: int


# The layout's last line; small models often write "The answer is: N", which states an answer all the same.
STATED = re.compile(r"The answer is:? \$?(-?[\d,]*\d)")
# A run of arithmetic text holding an "=": "2 * (46 + 32) = 2 * 78 = 156", "$340 - $102 = $238".
EQUATION = re.compile(r"[\d$+\-*/() .,]*=[\d$+\-*/() .,=]*")
OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def read_solution(answer: str) -> Solution:
    """The stated answer and the arithmetic steps of a worked answer up to the answer it states (what a model
    writes after that is not part of its solution). A step is true when every side of its "=" has one value."""
    stated = STATED.search(answer)
    worked = answer[: stated.start()] if stated else answer
    steps = right = 0
    sentences = re.split(r"\.(?:\s|$)", worked)  # a period then a space ends a sentence; "21.7" is a number
    for equation in (found for sentence in sentences for found in EQUATION.findall(sentence)):
        sides = [side.replace("$", "").replace(",", "").strip(" .") for side in equation.split("=")]
        if not any(symbol in sides[0] for symbol in "+-*/"):
            continue  # "30% of $340 = $102": the operation is in words, outside the run
        steps += 1
        values = [_value(side) for side in sides]
        right += None not in values and all(abs(v - values[0]) < 1e-9 for v in values)
    return Solution(stated.group(1).replace(",", "") if stated else None, steps, right)


def _value(expression: str) -> float | None:
    """The value of +, -, *, / and brackets over numbers (no other Python), or None where it is not one."""
    try:
        return _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):  # RecursionError: brackets nested deep
        return None


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
        return OPERATIONS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("not arithmetic")

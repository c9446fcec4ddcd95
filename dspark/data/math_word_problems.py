"""Synthetic grade-school word problems: the `mathword` prompt source (prompt_sources.py).

No math word-problem set ships in a wheel this project can install (only competition math:
CHAMP's 270 problems), yet math requests are a regime a serving system is asked in and the one
the math benchmark serves in. What a drafter or an n-gram datastore learns from a prompt is the
target's way of ANSWERING it (its phrasing of a step-by-step solution), so prompts only need the
shape of a grade-school problem: a few quantities, one to four arithmetic steps, a question.
They are generated here from templates, seeded, so a given (seed, index) is always the same
problem. Each problem gets one of a few instruction endings, the first the standard
chain-of-thought instruction that math requests commonly carry.

Nothing here reads a benchmark; prompt_sources.build_prompts still decontaminates the output
like any other source (13-word n-grams against all benchmark turns).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

NAMES = (
    "Maya", "Liam", "Olivia", "Noah", "Emma", "Ava", "Lucas", "Mia", "Ethan", "Sofia", "Mateo", "Zoe", "Aiden",
    "Priya", "Ravi", "Chen", "Mei", "Hiro", "Yuki", "Omar", "Fatima", "Kwame", "Amara", "Diego", "Lucia", "Ivan",
    "Anya", "Tom", "Grace", "Ben", "Chloe", "Sam", "Nina", "Leo", "Hannah", "Jack", "Ruby", "Oscar", "Ella",
    "Marcus", "Julia", "Felix", "Clara", "Hugo", "Iris", "Tariq", "Leila", "Jonas", "Freya", "Mr. Patel",
    "Mrs. Garcia", "Ms. Kim", "Mr. Okafor", "Grandma Rose", "Coach Rivera",
)
ITEMS = (
    ("apple", "apples"), ("pencil", "pencils"), ("cookie", "cookies"), ("marble", "marbles"), ("book", "books"),
    ("sticker", "stickers"), ("cupcake", "cupcakes"), ("orange", "oranges"), ("toy car", "toy cars"),
    ("seashell", "seashells"), ("balloon", "balloons"), ("notebook", "notebooks"), ("flower", "flowers"),
    ("egg", "eggs"), ("card", "cards"), ("muffin", "muffins"), ("bead", "beads"), ("candle", "candles"),
    ("stamp", "stamps"), ("tomato", "tomatoes"), ("potato", "potatoes"), ("brick", "bricks"), ("shirt", "shirts"),
    ("ticket", "tickets"), ("puzzle", "puzzles"), ("lemon", "lemons"), ("sandwich", "sandwiches"),
)
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("crate", "crates"), ("jar", "jars"),
              ("pack", "packs"), ("tray", "trays"), ("shelf", "shelves"))
PLACES = ("the farmers' market", "the bake sale", "the school fair", "the corner shop", "the flea market",
          "the bookstore", "the garden centre", "the craft fair", "the grocery store", "the toy store")
ENDINGS = (
    "\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "\nPlease reason step by step, and put your final answer within \\boxed{}.",
    " Show your work.",
    " Explain your answer step by step.",
    "",
)


def _money(cents: int) -> str:
    return f"${cents // 100}" if cents % 100 == 0 else f"${cents // 100}.{cents % 100:02d}"


def _buy_and_change(r: random.Random) -> str:
    name, (one, many) = r.choice(NAMES), r.choice(ITEMS)
    n, price = r.randint(2, 12), r.choice((25, 50, 75, 100, 125, 150, 200, 250, 300, 450))
    paid = (n * price // 1000 + 1) * 1000 + r.choice((0, 1000, 2000))
    return (f"{name} buys {n} {many} at {r.choice(PLACES)}. Each {one} costs {_money(price)}. "
            f"{name} pays with {_money(paid)}. How much change does {name} get back?")


def _sell_remainder(r: random.Random) -> str:
    name, (_, many) = r.choice(NAMES), r.choice(ITEMS)
    made, kept, gift = r.randint(20, 60), r.randint(2, 8), r.randint(2, 8)
    price = r.choice((50, 100, 150, 200, 300))
    return (f"{name} makes {made} {many} every week. {name} keeps {kept} for the family and gives {gift} to "
            f"friends. The rest are sold at {r.choice(PLACES)} for {_money(price)} each. "
            f"How much money does {name} make from them each week?")


def _containers(r: random.Random) -> str:
    name, (_, many), (box, boxes) = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    k, per, extra = r.randint(3, 15), r.randint(4, 24), r.randint(1, 20)
    return (f"{name} has {k} {boxes} of {many} with {per} {many} in each {box}, and {extra} loose {many}. "
            f"How many {many} does {name} have in total?")


def _share_equally(r: random.Random) -> str:
    name, (_, many) = r.choice(NAMES), r.choice(ITEMS)
    friends = r.randint(2, 9)
    each = r.randint(3, 15)
    left = r.randint(0, friends - 1)
    return (f"{name} has {friends * each + left} {many} and shares them equally among {friends} friends, "
            f"keeping whatever is left over. How many {many} does each friend get, and how many are left over?")


def _speed_distance(r: random.Random) -> str:
    name = r.choice(NAMES)
    vehicle = r.choice(("bike", "car", "train", "bus", "scooter"))
    speed, hours = r.choice((12, 15, 20, 30, 45, 48, 60, 72, 80)), r.randint(2, 6)
    unit = r.choice(("miles", "kilometers"))
    return (f"{name} travels by {vehicle} at {speed} {unit} per hour for {hours} hours, then rests and travels "
            f"{r.randint(5, 40)} more {unit}. How many {unit} does {name} travel in all?")


def _work_rate(r: random.Random) -> str:
    name, (_, many) = r.choice(NAMES), r.choice(ITEMS)
    per_hour, hours, days = r.randint(3, 30), r.randint(2, 9), r.randint(2, 7)
    return (f"{name} can pack {per_hour} {many} in an hour and works {hours} hours a day. "
            f"How many {many} does {name} pack in {days} days?")


def _percent_discount(r: random.Random) -> str:
    name = r.choice(NAMES)
    thing = r.choice(("jacket", "bicycle", "video game", "pair of shoes", "backpack", "lamp", "tent", "guitar"))
    price, pct = r.choice((20, 40, 50, 60, 80, 120, 150, 200, 250, 400)), r.choice((10, 15, 20, 25, 30, 40, 50))
    return (f"A {thing} costs ${price}. It is on sale for {pct}% off. {name} buys it on sale. "
            f"How much does {name} pay?")


def _percent_of_group(r: random.Random) -> str:
    total, pct = r.choice((20, 40, 50, 60, 80, 100, 120, 200, 250, 300, 400, 500)), r.choice((10, 20, 25, 30, 40, 60, 75))
    group = r.choice(("students in a school", "people at a concert", "trees in an orchard", "cars in a parking lot",
                      "books in a library", "animals on a farm"))
    part = r.choice(("are", "were"))
    return (f"There are {total} {group}. {pct}% of them {part} new this year. "
            f"How many of them {part} not new this year?")


def _ages(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    age, times, years = r.randint(3, 14), r.randint(2, 4), r.randint(2, 10)
    return (f"{a} is {age} years old. {b} is {times} times as old as {a}. "
            f"How old will {b} be in {years} years?")


def _fractions(r: random.Random) -> str:
    name, (_, many) = r.choice(NAMES), r.choice(ITEMS)
    den = r.choice((2, 3, 4, 5, 6, 8, 10))
    num = r.randint(1, den - 1)
    total = den * r.randint(2, 12)
    other = r.randint(1, total - total * num // den) if total - total * num // den > 1 else 1
    return (f"{name} had {total} {many}. {name} gave away {num}/{den} of them and then lost {other} more. "
            f"How many {many} does {name} have now?")


def _compare_totals(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    (_, many) = r.choice(ITEMS)
    x, more = r.randint(5, 40), r.randint(2, 20)
    return (f"{a} collected {x} {many}. {b} collected {more} more {many} than {a}. "
            f"How many {many} did they collect together?")


def _weekly_savings(r: random.Random) -> str:
    name = r.choice(NAMES)
    goal = r.choice(("a bike", "a game console", "a trip", "a telescope", "a new phone", "a skateboard"))
    cost, saved, per_week = r.choice((120, 150, 200, 240, 300, 360, 500)), r.choice((0, 20, 30, 40, 60)), r.choice((10, 12, 15, 20, 25, 30))
    return (f"{name} wants to buy {goal} that costs ${cost}. {name} has already saved ${saved} and saves "
            f"${per_week} every week. How many weeks will it take {name} to have enough money?")


def _time_schedule(r: random.Random) -> str:
    name = r.choice(NAMES)
    start_h, start_m = r.randint(6, 10), r.choice((0, 15, 30, 45))
    tasks = r.sample(("reading", "homework", "piano practice", "soccer", "chores", "cooking", "painting"), 3)
    mins = [r.choice((15, 20, 25, 30, 40, 45, 50, 60)) for _ in tasks]
    steps = ", then ".join(f"{m} minutes of {t}" for t, m in zip(tasks, mins))
    return f"{name} starts at {start_h}:{start_m:02d} AM and does {steps}. At what time does {name} finish?"


def _area_perimeter(r: random.Random) -> str:
    name = r.choice(NAMES)
    length, width = r.randint(5, 30), r.randint(3, 20)
    thing = r.choice(("garden", "room", "playground", "patio", "field", "pool cover"))
    cost = r.choice((2, 3, 4, 5, 8, 10, 12))
    ask = r.choice((f"How much does it cost to cover it at ${cost} per square meter?",
                    f"How much does a fence around it cost at ${cost} per meter?"))
    return f"{name}'s rectangular {thing} is {length} meters long and {width} meters wide. {ask}"


def _recipe_scaling(r: random.Random) -> str:
    name = r.choice(NAMES)
    serves, want = r.choice((2, 4, 6, 8)), r.choice((3, 10, 12, 16, 20, 24))
    ingredient = r.choice(("cups of flour", "eggs", "cups of milk", "tablespoons of sugar", "grams of butter"))
    amount = r.randint(1, 6) * (50 if "grams" in ingredient else 1)
    return (f"A recipe that serves {serves} people needs {amount} {ingredient}. {name} wants to cook for {want} "
            f"people. How many {ingredient} does {name} need?")


def _multi_step_shop(r: random.Random) -> str:
    name = r.choice(NAMES)
    picks = r.sample(ITEMS, 3)
    parts = [(r.randint(2, 8), p[1], r.choice((50, 75, 100, 125, 150, 200, 250, 300))) for p in picks]
    listing = ", ".join(f"{n} {many} for {_money(c)} each" for n, many, c in parts[:-1])
    n, many, c = parts[-1]
    return (f"At {r.choice(PLACES)}, {name} buys {listing}, and {n} {many} for {_money(c)} each. "
            f"How much does {name} spend altogether?")


def _average(r: random.Random) -> str:
    name = r.choice(NAMES)
    k = r.randint(3, 6)
    scores = [r.randint(55, 100) for _ in range(k)]
    what = r.choice(("test scores", "points in each game", "minutes of running each day", "pages read each day"))
    return f"{name}'s {what} this week were {', '.join(map(str, scores[:-1]))} and {scores[-1]}. What is the average?"


def _hourly_wage(r: random.Random) -> str:
    name = r.choice(NAMES)
    wage, hours, overtime = r.choice((10, 12, 15, 18, 20, 25)), r.choice((20, 30, 35, 40)), r.randint(2, 10)
    return (f"{name} earns ${wage} an hour for the first {hours} hours of a week and 1.5 times that rate for "
            f"every hour after that. How much does {name} earn in a week of {hours + overtime} hours?")


def _unit_conversion(r: random.Random) -> str:
    name = r.choice(NAMES)
    liters, cup_ml = r.choice((1, 2, 3, 5)), r.choice((200, 250, 500))
    return (f"{name} has {liters} liters of juice and pours it into glasses that hold {cup_ml} milliliters each. "
            f"How many glasses can {name} fill?")


def _growth(r: random.Random) -> str:
    what = r.choice(("a plant", "a sunflower", "a bamboo shoot", "a puppy's weight", "a savings account"))
    start, per, weeks = r.randint(2, 30), r.randint(1, 6), r.randint(3, 12)
    unit = "dollars" if "savings" in what else "pounds" if "weight" in what else "centimeters"
    return (f"{what[0].upper() + what[1:]} starts at {start} {unit} and grows by {per} {unit} every week. "
            f"What will it be after {weeks} weeks?")


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _buy_and_change, _sell_remainder, _containers, _share_equally, _speed_distance, _work_rate, _percent_discount,
    _percent_of_group, _ages, _fractions, _compare_totals, _weekly_savings, _time_schedule, _area_perimeter,
    _recipe_scaling, _multi_step_shop, _average, _hourly_wage, _unit_conversion, _growth,
)


def word_problem(seed: int, index: int) -> str:
    """Problem `index` of the stream `seed`: a template, its quantities and an ending, all from
    one generator seeded by (seed, index), so a problem never depends on how many came before."""
    r = random.Random(f"mathword:{seed}:{index}")
    return r.choice(TEMPLATES)(r) + r.choice(ENDINGS)


def word_problems(count: int, seed: int = 0) -> Iterator[str]:
    for i in range(count):
        yield word_problem(seed, i)

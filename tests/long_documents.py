"""Long benign documents for the guard's long-input tests and benchmarks: retrieved-text-like prose, varied enough
that no two windows repeat (a repeated window is scored once, which would make a long scan look cheaper than it
is), made the same way for the same seed."""

from __future__ import annotations

import random

SUBJECTS = [
    "The quarterly report",
    "Our support team",
    "The new warehouse in Rotterdam",
    "The hiring plan for engineering",
    "The customer survey from March",
    "The migration to the new billing system",
    "The board's planning meeting",
    "The regional sales office",
    "The onboarding guide for new staff",
    "The maintenance schedule for the delivery vans",
    "The travel policy",
    "The product roadmap for the autumn",
]
PREDICATES = [
    "shows that shipping times fell by {n} percent compared with last year",
    "describes how returns are handled when a parcel arrives damaged",
    "lists {n} open positions, most of them for backend developers and support agents",
    "recommends booking train tickets at least {n} days before a trip",
    "explains which invoices need a second signature before payment",
    "notes that the cafeteria will be closed for renovation for {n} weeks",
    "summarises the feedback of {n} customers about the mobile app",
    "suggests moving the weekly status call to Thursday mornings",
    "compares three suppliers of packaging material on price and delivery time",
    "points out that the heating in the second building needs servicing",
    "proposes a budget of {n} thousand euros for the training programme",
    "describes the steps for requesting a new laptop through the service desk",
    "mentions that the spring conference will take place in Lisbon",
    "sets out the holiday rota for the {n} members of the night shift",
    "reviews the energy use of the offices and suggests switching to LED lighting",
]
ENDINGS = [
    "",
    " The figures are preliminary and will be confirmed next month.",
    " Questions can be sent to the team's shared mailbox.",
    " A short summary is attached at the end of the document.",
    " The details are in the appendix on page {n}.",
    " Everyone involved agreed to review it again after the summer.",
]


def document(words: int, seed: int = 0) -> str:
    """About `words` words of benign prose (the English guard model reads ~1.2 tokens a word of it)."""
    rng = random.Random(seed)
    parts: list[str] = []
    count = 0
    while count < words:
        sentence = (
            f"{rng.choice(SUBJECTS)} {rng.choice(PREDICATES)}.{rng.choice(ENDINGS)}".replace(
                "{n}", str(rng.randint(2, 400))
            )
            + " "
        )
        parts.append(sentence)
        count += len(sentence.split())
    return "".join(parts)

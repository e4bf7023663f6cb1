"""What the input guard reads of a request: the texts of its content inventory (gateway/apis/inventory.py), each
with its provenance (message role, tool result, document, reasoning, tool-call arguments, tool definitions, role-less
prompt, unknown) and its place.

Prompts sent as token ids are decoded back to text: the model reads the ids as surely as text, so ids the guard cannot
read would be a way around it. Role-less prompts and unknown content are read whatever the policy's roles.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from gateway.apis.encoded import DecodedText
from gateway.apis.inventory import Carried, Inventory
from gateway.guard.spec import provenances
from gateway.json_path import dotted

# Token ids → their text, or None when no tokenizer is known for the model (the caller decides what that means).
Decode = Callable[[list[int], str], str | None]


def request_texts(inventory: Inventory, roles: Collection[str], decode: Decode) -> list[Carried]:
    """The texts of the request that these roles select, in payload order. A decoded token-id prompt has no holder:
    it cannot be rewritten in place."""
    wanted = provenances(roles)
    texts = [c for c in inventory.carried if c.kind == "text" and c.provenance in wanted]
    decoded = [
        Carried(prompt.loc, None, "text", "prompt", prompt.loc, DecodedText(plain))
        for prompt in inventory.token_prompts
        if (plain := decode(prompt.ids, dotted(prompt.loc))) is not None
    ]
    if decoded:  # prompts given partly as text, partly as ids: back in the order they were sent
        texts = sorted(texts + decoded, key=lambda t: t.loc)
    return texts


def selected(texts: list[Carried], roles: Collection[str]) -> list[Carried]:
    """The texts one policy's roles select."""
    wanted = provenances(roles)
    return [t for t in texts if t.provenance in wanted]

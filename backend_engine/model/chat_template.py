"""Render a model's Jinja chat template in a sandbox (templates come from model files)."""

from __future__ import annotations

import json
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: ChatML, which SmolLM2 and many others use.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# what `render` passes the template itself: a caller's extra arguments may not replace these
RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The template rejected the messages (raise_exception) or failed to render."""


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
            v, indent=indent, ensure_ascii=ensure_ascii
        )
        self.source = source or CHATML
        self.template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - the request's own values (chat_template_kwargs) broke the template
            raise ChatTemplateError(f"chat template failed on this request's values: {e!r}") from e

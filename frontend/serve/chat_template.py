"""Chat templates rendered with jinja2, in the environment Hugging Face documents for them.

A model's chat template (``tokenizer.chat_template``) is Jinja written against a fixed set of
helpers, and it comes with the model files, so it is untrusted code: it runs in jinja2's immutable
sandbox (no attribute access to internals, no mutation of the messages it is given). What templates
may rely on:

- ``trim_blocks`` and ``lstrip_blocks`` (a block tag's line leaves no whitespace behind), and the
  ``{% break %}`` / ``{% continue %}`` loop controls;
- ``raise_exception``, given a message, to refuse input (a TemplateError whose message is the template's);
- ``strftime_now``, given a format: the local date and time, for templates that state today's date;
- ``tojson`` that keeps non-ASCII characters as they are and takes ``indent``, ``separators`` and
  ``sort_keys`` (jinja2's own filter escapes HTML characters, which would change the prompt);
- ``{% generation %}...{% endgeneration %}`` around assistant text (training templates mark it so):
  rendered as its body.

Why not transformers' ``apply_chat_template``: it needs transformers, and with it torch, in a process
that otherwise needs neither.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2


def render_chat(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """``template`` rendered for ``messages`` (keys whose value is None left out, the way templates
    test for a missing field) and the other ``variables`` (``tools``, ``add_generation_prompt``, the
    special tokens' text, anything a template reads)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compiled(template).render(messages=messages, **variables)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """Compiling is the slow part; a server renders one template (or a few) for every request."""
    return _environment().from_string(template)


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}`` ... ``{% endgeneration %}``: the body, unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)

"""A griffe extension (loaded by mkdocs.yml) that reads leanstep's docstrings as Markdown renders them.

leanstep's docstrings are Google style with a few Sphinx habits. This rewrites the text that
mkdocstrings renders, never the source:

- ``Example:`` is Google style's admonition, not its examples section, so the ``>>>`` lines under
  it would render as block quotes (and ``x["w"][0]`` as broken reference links); it becomes
  ``Examples:``, which griffe renders as code.
- Sphinx roles (``:func:`global_norm```) become code spans.
- ``.. code-block:: text`` and ``.. math::`` lines go (the indented block under them stays a code
  block), and a paragraph's closing ``::`` becomes ``:``.
- A ``Raises:`` section whose first item names no exception (``The errors of ...``) reads as
  ``Exception: The errors of ...`` (griffe drops an item without a name, with a warning).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const|math):`~?([^`]+)`")
_DIRECTIVE = re.compile(r"^\s*\.\. (?:code-block|math)::.*$", re.MULTILINE)
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)
_UNNAMED_RAISE = re.compile(r"^([ \t]*Raises:\n[ \t]+)(?=\S)(?![\w.]+(?:, [\w.]+)*:)", re.MULTILINE)


def markdown_docstring(text: str) -> str:
    """The docstring ``text`` with the rewrites above."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(r"`\1`", text)
    text = _DIRECTIVE.sub("", text)
    text = _UNNAMED_RAISE.sub(r"\1Exception: ", text)
    return _LITERAL.sub(r"\1:", text)


class MarkdownDocstrings(griffe.Extension):
    """Applies :func:`markdown_docstring` to every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)

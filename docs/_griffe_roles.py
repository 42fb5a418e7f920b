"""Docs build helper: the docstrings' Sphinx roles (:func:`x`, :class:`~a.b.C`) as Markdown code.

Loaded by mkdocstrings (``mkdocs.yml``, ``extensions``); nothing imports it at run time.
"""

import re

import griffe

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring once it is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)

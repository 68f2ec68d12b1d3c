"""A Griffe extension for the docs site (mkdocs.yml): the package's docstrings cite other objects with
Sphinx roles (``:class:`DPFedAvg```, ``:math:`z C```), which Markdown would show with the role's name
in front; this renders each as the inline code it names (a leading ``~`` dropped)."""

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|math):`~?([^`]+)`")


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)

"""The parts of PromQL and of Grafana's templating the dashboard tests need.

`metric_names(expr)`: the metric names a PromQL expression reads. `substitute(text, values)`:
Grafana's variable syntax (`$name`, `${name}`, `[[name]]`) replaced from `values`; names not
in `values` are left as they are, as Grafana leaves them (`"$1"` in `label_replace`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "Inf", "NaN",
}  # fmt: skip
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def metric_names(expr: str) -> set[str]:
    """Names of the metrics `expr` selects (functions, keywords and label names excluded)."""
    s = _STRING.sub('""', expr)
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)
    s = _LABEL_LIST.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        rest = s[m.end() :].lstrip()
        if rest.startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def substitute(text: str, values: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return values.get(name, m.group(0))

    return _VARIABLE.sub(one, text)

"""Built-in workloads: real prompts for end-to-end speculative decoding.

``prompts.jsonl`` (a copy of the project's ``shared/workloads``) holds one
prompt a line: ``name``, ``kind`` (code, chat, creative, multilingual),
``max_new_tokens`` and chat ``messages``. The code prompts quote functions of
the Python standard library (PSF license). Code rewriting, where the output
copies the input, is where drafting shines; open-ended prose is where it must
not slow anything down.
"""

from __future__ import annotations

import json
from importlib import resources


def load(kinds=None, names=None) -> list:
    """The built-in prompts as dicts, optionally only these kinds or names.

    Examples
    --------
    >>> [w["name"] for w in load(kinds=["code"])][:2]
    ['code-rewrite-dedent', 'code-rewrite-rgb']
    """
    text = resources.files(__name__).joinpath("prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if kinds:
        rows = [r for r in rows if r["kind"] in kinds]
    if names:
        rows = [r for r in rows if r["name"] in names]
    return rows


def is_prose(workload: dict) -> bool:
    """True for open-ended text (chat, creative, multilingual), False for code."""
    return workload["kind"] != "code"

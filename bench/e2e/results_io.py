"""Where the end-to-end benchmarks write: ``NAME.json`` (everything measured)
and ``NAME.md`` (the table) under one folder."""

from __future__ import annotations

import json
import os


def save(out: str, name: str, results: dict, table: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table)

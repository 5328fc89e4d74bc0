"""What every benchmark script shares: the flat JSON file of figures (`--json PATH`)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, figures: dict[str, Any]) -> None:
    """A flat JSON object of named figures, sorted, creating the folder if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(figures, fh, indent=1, sort_keys=True)
        fh.write("\n")

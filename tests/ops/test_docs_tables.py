"""The reference tables of the docs name what the daemon really has: every configuration key
(docs/operations.md, Configuration), every metric family a running daemon exports (Metrics) and
every operation the protocol defines (docs/protocol.md 3.2). A key, metric or operation added
without its row, or a row left behind by one removed, fails here: operators and third-party
client writers read these tables, not the code."""

from __future__ import annotations

import re
from pathlib import Path

from radixd_client import protocol as P

from daemon.config import (
    AdminConfig,
    CheckerConfig,
    Config,
    L3Config,
    ModelConfig,
    ServerConfig,
    TenantConfig,
)

from .conftest import ADMIN_TOKEN, parse_metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
SECTIONS = {"Top level": Config, "`[server]`": ServerConfig, "`[admin]`": AdminConfig,
            "`[checker]`": CheckerConfig, "`[l3]`": L3Config, "`[[models]]`": ModelConfig,
            "`[[tenants]]`": TenantConfig}


def _table_names(lines: list[str]) -> set[str]:
    """The names in backquotes in the first cell of each row of the tables in ``lines``."""
    return {name for line in lines if line.startswith("| `")
            for name in re.findall(r"`([a-z_0-9]+)`", line.split("|")[1])}


def _section(text: str, heading: str) -> list[str]:
    """The lines under the ``### heading`` (and whatever follows it on its line) up to the
    next heading of its level or above."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line == f"### {heading}" or line.startswith(f"### {heading} ")) + 1
    end = next((i for i in range(start, len(lines)) if re.match(r"#{1,3} ", lines[i])),
               len(lines))
    return lines[start:end]


def test_every_configuration_key_has_its_row() -> None:
    text = (DOCS / "operations.md").read_text()
    for heading, model in SECTIONS.items():
        keys = set(model.model_fields)
        if model is Config:
            keys -= {"server", "admin", "checker", "l3", "models", "tenants"}
        assert _table_names(_section(text, heading)) == keys, heading


def test_every_exported_metric_family_has_its_row(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    exported = set(parse_metrics(d.get("/metrics").text)[0])
    text = (DOCS / "operations.md").read_text()
    documented = {n for n in _table_names(_section(text, "Metrics")) if n.startswith("radixd_")}
    assert documented == exported


def test_every_operation_is_in_the_protocols_list() -> None:
    row = next(line for line in (DOCS / "protocol.md").read_text().splitlines()
               if line.startswith("| `op` |"))
    assert set(re.findall(r"`([a-z_]+)`", row.split("|")[3])) == set(P.OPS)

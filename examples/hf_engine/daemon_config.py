"""The daemon side of the model: its ``[[models]]`` entry, and the check that a daemon agrees.

The daemon knows nothing of the model but the KV layout. The layout must match the model
exactly (layer counts per kind, KV heads, head dim, dtype, window), or the engine would read
pages of another shape; :func:`check_model_info` refuses a daemon whose profile differs.
"""

from __future__ import annotations

from typing import Any

from radixd_client.protocol import ModelInfo
from transformers import Qwen2Config

from .model import layer_slots, window_of


def daemon_model_config(config: Qwen2Config, *, name: str = "hf-tiny", page_size: int = 4,
                        full_pages: int = 512, swa_pages: int = 256,
                        **extra: Any) -> dict[str, Any]:
    """The ``[[models]]`` table of radixd's config for this model, as a dict.

    The daemon's ``sliding_window`` is the HF ``sliding_window`` W. In HF's mask a query at
    position i sees keys ``(i - W, i]``: itself and the W - 1 tokens before it. The daemon keeps
    the last W tokens live (one more than needed), so W is a safe value and the engine never reads
    a page the daemon may have dropped. ``extra`` adds keys such as ``host_pages`` or
    ``write_policy``.
    """
    slots = layer_slots(config)
    window = window_of(config)
    entry: dict[str, Any] = {
        "name": name,
        "page_size": page_size,
        "sliding_window": window if window is not None else 0,  # TOML: 0 means none
        "num_full_layers": sum(s.pool == "full" for s in slots),
        "num_swa_layers": sum(s.pool == "swa" for s in slots),
        "num_kv_heads": int(config.num_key_value_heads),
        "head_dim": int(config.head_dim),
        "dtype": "float32",
        "device": "cpu",
        "full_pages": full_pages,
        "swa_pages": swa_pages if window is not None else 0,
    }
    entry.update(extra)
    return entry


def check_model_info(info: ModelInfo, config: Qwen2Config) -> None:
    """Raise ValueError naming every field where the daemon's profile differs from the model."""
    want = daemon_model_config(config, name=info.name)
    window = window_of(config)
    got = {
        "sliding_window": info.sliding_window,
        "num_full_layers": info.num_full_layers,
        "num_swa_layers": info.num_swa_layers,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "dtype": info.dtype,
    }
    expected = {key: want[key] for key in got}
    expected["sliding_window"] = window
    bad = [f"{key}: daemon {got[key]!r}, model {expected[key]!r}"
           for key in got if got[key] != expected[key]]
    if info.device != "cpu":
        bad.append(f"device: daemon {info.device!r}, this engine runs on 'cpu'")
    if bad:
        raise ValueError(f"radixd model {info.name!r} does not fit this model: " + "; ".join(bad))


def to_toml(config: dict[str, Any]) -> str:
    """A radixd config (top-level keys, tables, arrays of tables) as TOML text.

    Enough for the example's own configs (str, int, float, bool values); the daemon reads it with
    ``radixd serve --config``.
    """

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    def is_tables(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [f"{k} = {value(v)}" for k, v in config.items()
             if not isinstance(v, dict) and not is_tables(v)]
    for key, v in config.items():
        if isinstance(v, dict):
            lines.append(f"\n[{key}]")
            lines += [f"{k} = {value(x)}" for k, x in v.items()]
        elif is_tables(v):
            for table in v:
                lines.append(f"\n[[{key}]]")
                lines += [f"{k} = {value(x)}" for k, x in table.items() if x is not None]
    return "\n".join(lines).lstrip("\n") + "\n"

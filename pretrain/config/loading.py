"""Config files, DeepSpeed JSONs and `--set` overrides read into plain mappings, and the layers
of a build merged: preset < config file < --ds JSON < --set overrides (validated once, by `tree`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from pretrain.errors import ConfigError


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


GLOBAL_BATCH = ("global_batch_sequences", "global_batch_tokens")
_SPLIT_BATCH = ("gradient_accumulation_steps", "train_batch_size")


def merge_layer(lower: dict[str, Any], upper: dict[str, Any]) -> dict[str, Any]:
    """`deep_merge` of one layer of the build over the layers below it, where a batch stated one way
    replaces the other way below it: a global batch (which derives the accumulation) drops an
    accumulation, a train_batch_size and the other global batch field of the layers below, and an
    accumulation or train_batch_size drops their global batch. Within one layer both are checked
    against each other."""
    up, low = upper.get("batch"), lower.get("batch")
    if isinstance(up, dict) and isinstance(low, dict):
        drop = (
            GLOBAL_BATCH + _SPLIT_BATCH
            if any(k in up for k in GLOBAL_BATCH)
            else GLOBAL_BATCH
            if any(k in up for k in _SPLIT_BATCH)
            else ()
        )
        lower = {**lower, "batch": {k: v for k, v in low.items() if k not in drop}}
    return deep_merge(lower, upper)


def parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}, the value parsed as a YAML scalar."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"--set {item!r}: expected key=value, e.g. model.n_layer=4"], "override")
    try:
        value = yaml.load(raw, _UniqueKeyLoader) if raw.strip() else raw
    except yaml.constructor.ConstructorError as e:
        raise ConfigError([f"--set {item!r}: {e.problem}"], "override") from None
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last) and
    an integer that is not plain decimal, which YAML 1.1 reads in another base: a leading zero as
    octal (`n_layer: 010` is 8), `0x10` as hexadecimal (16), `0b11` as binary (3), `1:30` as
    base 60 (90)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(node.value).replace("_", "").lstrip("+-")
        value = int(super().construct_yaml_int(node))
        if len(text) > 1 and text[0] == "0" and text[1].isdigit():
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value}: a number with a leading 0 reads as octal in YAML "
                f"({value}); write it without the 0", node.start_mark,
            )  # fmt: skip
        base = {"0x": "hexadecimal", "0b": "binary"}.get(text[:2].lower(), "base 60" if ":" in text else None)
        if base is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value}: YAML reads this as a {base} number ({value}); write it in "
                f"decimal ({value}), or quote it where text is meant", node.start_mark,
            )  # fmt: skip
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: give each key once", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: a key given twice in one object is an error, not the last one wins."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}: give each key once")
        out[key] = value
    return out


MAX_CONFIG_BYTES = 4_000_000
MAX_CONFIG_NODES = 100_000


def _expanded_size(node: Any, seen: dict[int, int]) -> int:
    """Values in `node` with every shared (aliased) part counted each time it appears."""
    if not isinstance(node, dict | list):
        return 1
    if id(node) not in seen:
        seen[id(node)] = 0  # a cycle counts once
        children = node.values() if isinstance(node, dict) else node
        seen[id(node)] = 1 + sum(_expanded_size(c, seen) for c in children)
    return seen[id(node)]


def _placeholders(text: str) -> str:
    """A hint where a JSON holds a template's bare names for values (`"train_batch_size": GB_SIZE`)."""
    names = sorted(set(re.findall(r":\s*([A-Z][A-Z0-9_]*)\s*[,}\n]", text)) - {"NaN", "Infinity"})
    if not names:
        return ""
    return (
        f"; it is a template with placeholder values ({', '.join(names)}): write a value for each, as the "
        "script it came with does before it launches"
    )


def load_file(path: str | Path) -> dict[str, Any]:
    """A config file or a DeepSpeed JSON: a mapping, each key given once, UTF-8 text."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"{p}: {'not a regular file' if p.exists() else 'no such file'}"], "config file")
    kind = "JSON" if p.suffix == ".json" else "YAML"
    text = ""
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                [
                    f"{p}: {size:,} bytes; a config is a few KB (at most {MAX_CONFIG_BYTES:,}): is it the right file?"
                ],
                "config file",
            )
        text = p.read_text(encoding="utf-8")
        if p.suffix not in (".yaml", ".yml") and text.lstrip().startswith("{"):
            kind = "JSON"  # a DeepSpeed JSON by another name (ds_config.conf): YAML reads 1e5 as text
        data = (
            json.loads(text, object_pairs_hook=_unique_pairs)
            if kind == "JSON"
            else yaml.load(text, _UniqueKeyLoader)
        )
    except UnicodeDecodeError as e:
        raise ConfigError(
            [f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); is it the right file?"], "config file"
        ) from None
    except OSError as e:
        raise ConfigError([f"{p}: unreadable ({e.strerror or e})"], "config file") from None
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(
            [f"{p}: not valid {kind}: {str(e)[:500]}{_placeholders(text)}"], "config file"
        ) from None
    except RecursionError:
        raise ConfigError([f"{p}: nested too deeply to be a config"], "config file") from None
    if data is None:
        return {}
    try:
        huge = _expanded_size(data, {}) > MAX_CONFIG_NODES  # YAML aliases can make a small file huge
    except RecursionError:
        huge = True
    if huge:
        raise ConfigError(
            [f"{p}: nested too deeply or expands to over {MAX_CONFIG_NODES:,} values (YAML aliases?)"],
            "config file",
        )
    if not isinstance(data, dict):
        raise ConfigError([f"{p}: top level must be a mapping, got {type(data).__name__}"], "config file")
    return data

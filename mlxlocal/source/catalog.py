"""The model catalog (models.toml): short aliases for Hub repos and synthetic presets.

The file ships inside the wheel as ``mlxlocal/models.toml``; in a source checkout it
lives at the repository root, one level above the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]

import mlxlocal
from mlxlocal.errors import ConfigError

CHAT_TEMPLATES = ("chatml", "llama3", "mistral")
QUANTS = ("4bit", "8bit", "bf16", "fp16")
_ALIAS_FIELDS: dict[str, type] = {
    "repo": str,
    "family": str,
    "params": str,
    "quant": str,
    "context": int,
    "description": str,
}
# Fields every synthetic preset needs so that mlx-lm can build the model.
_PRESET_REQUIRED = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class Alias:
    name: str
    repo: str
    family: str
    params: str
    quant: str
    context: int
    description: str


@dataclass(frozen=True)
class SyntheticPreset:
    name: str
    description: str
    chat_template: str
    config: dict[str, Any] = field(hash=False)
    train: str | None = None  # trained here instead of random weights (synthetic/trained.py)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


def normalize_name(name: str) -> str:
    """`Qwen3:0.6B` -> `qwen3-0.6b`: Ollama-style tags and case do not matter."""
    return name.strip().lower().replace(":", "-")


def _loose(name: str) -> str:
    # `llama3.2-1b` and `llama-3.2-1b` mean the same thing to a user.
    return "".join(ch for ch in normalize_name(name) if ch.isalnum())


def _lookup(table: dict[str, Any], name: str) -> Any | None:
    key = normalize_name(name)
    if key in table:
        return table[key]
    loose = [v for k, v in table.items() if _loose(k) == _loose(name)]
    return loose[0] if len(loose) == 1 else None


@dataclass
class Catalog:
    path: Path
    aliases: dict[str, Alias]
    synthetic: dict[str, SyntheticPreset]

    def find_alias(self, name: str) -> Alias | None:
        return _lookup(self.aliases, name)

    def find_preset(self, name: str) -> SyntheticPreset | None:
        return _lookup(self.synthetic, name)

    def alias_for_repo(self, repo: str) -> Alias | None:
        for alias in self.aliases.values():
            if alias.repo.lower() == repo.lower():
                return alias
        return None


def catalog_path() -> Path:
    """The packaged models.toml, else the one at the root of a source checkout."""
    here = Path(mlxlocal.__file__).parent
    for candidate in (here / "models.toml", here.parent / "models.toml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"models.toml not found next to {here} or in {here.parent}")


def _parse_alias(path: Path, name: str, raw: Any) -> Alias:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: [aliases.{name!r}] must be a table")
    values: dict[str, Any] = {}
    for key, typ in _ALIAS_FIELDS.items():
        value = raw.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ConfigError(
                f"{path}: alias {name!r} field {key!r} must be a {typ.__name__}, got {value!r}"
            )
        values[key] = value
    if "/" not in values["repo"]:
        raise ConfigError(f"{path}: alias {name!r} repo {values['repo']!r} is not owner/name")
    if values["quant"] not in QUANTS:
        raise ConfigError(f"{path}: alias {name!r} quant must be one of {QUANTS}")
    unknown = set(raw) - set(_ALIAS_FIELDS)
    if unknown:
        raise ConfigError(f"{path}: alias {name!r} has unknown fields {sorted(unknown)}")
    return Alias(name=name, **values)


def _parse_preset(path: Path, name: str, raw: Any) -> SyntheticPreset:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: [synthetic.{name!r}] must be a table")
    config = dict(raw)
    description = config.pop("description", "")
    template = config.pop("chat_template", None)
    train = config.pop("train", None)
    if train not in (None, "words"):
        raise ConfigError(f"{path}: preset {name!r} train must be \"words\", got {train!r}")
    if template not in CHAT_TEMPLATES:
        raise ConfigError(
            f"{path}: preset {name!r} chat_template must be one of {CHAT_TEMPLATES}, "
            f"got {template!r}"
        )
    missing = [key for key in _PRESET_REQUIRED if key not in config]
    if missing:
        raise ConfigError(f"{path}: preset {name!r} is missing config fields {missing}")
    if ":" in name:
        raise ConfigError(f"{path}: preset name {name!r} must not contain ':'")
    return SyntheticPreset(
        name=name, description=str(description), chat_template=template, config=config, train=train
    )


def load_catalog(path: Path | None = None) -> Catalog:
    """Parse models.toml; malformed entries raise ConfigError naming the entry."""
    path = path or catalog_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read model catalog {path}: {e}") from e
    unknown = set(data) - {"aliases", "synthetic"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level tables {sorted(unknown)}")
    aliases = {
        normalize_name(name): _parse_alias(path, normalize_name(name), raw)
        for name, raw in data.get("aliases", {}).items()
    }
    presets = {
        normalize_name(name): _parse_preset(path, normalize_name(name), raw)
        for name, raw in data.get("synthetic", {}).items()
    }
    return Catalog(path=path, aliases=aliases, synthetic=presets)


def find_alias(name: str) -> Alias | None:
    return load_catalog().find_alias(name)


def find_preset(name: str) -> SyntheticPreset | None:
    return load_catalog().find_preset(name)

"""Where models come from: local directories, catalog aliases, the Hugging Face Hub,
and synthetic presets.

Downloads go through `huggingface_hub.snapshot_download`, so the usual Hugging Face
environment applies (HF_HOME, HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE,
HF_HUB_DISABLE_PROGRESS_BARS). huggingface_hub reads those variables once at import;
we read the cache location and offline switch again at every call, so a variable set
after import (or by a test) still takes effect.

`resolve()` looks in the cache before the network: a model that is already downloaded
starts without any Hub request. `pull()` always asks the Hub, so it fetches updates.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlxlocal.errors import ModelLoadError, ModelNotFoundError
from mlxlocal.source import synthetic
from mlxlocal.source.catalog import load_catalog

Source = Literal["local", "alias", "hub", "synthetic"]

# Only what loading needs: weights, configs, tokenizers, chat templates.
# No *.py: we never run remote code.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    source: Source
    name: str
    repo: str | None = None


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    size_bytes: int
    nb_files: int
    last_modified: float  # POSIX timestamp
    revisions: tuple[str, ...]  # commit hashes
    path: Path  # snapshot of refs/main, else the newest one
    has_config: bool


def _env_true(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as it is set now."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = _env_true(name)
        if value is not None:
            return value
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub would compute it from the current environment."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expandvars(env[name])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def looks_like_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def _split_revision(spec: str) -> tuple[str, str | None]:
    """`owner/name@rev` -> (`owner/name`, `rev`)."""
    repo, sep, rev = spec.partition("@")
    return repo, (rev if sep and rev else None)


def _hub_error(repo: str, revision: str | None, err: Exception, offline: bool) -> ModelNotFoundError:
    """Turn a huggingface_hub exception into one actionable sentence."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    if isinstance(err, GatedRepoError):  # before RepositoryNotFoundError: it subclasses it
        msg = (f"{repo} is gated: accept its license at https://huggingface.co/{repo}, "
               "then log in with `hf auth login` or set HF_TOKEN")
    elif isinstance(err, RepositoryNotFoundError):
        msg = (f"{repo} was not found on the Hugging Face Hub (or it is private: log in with "
               "`hf auth login` or set HF_TOKEN)")
    elif isinstance(err, RevisionNotFoundError):
        msg = f"revision {revision!r} of {repo} does not exist on the Hugging Face Hub"
    elif isinstance(err, DisabledRepoError):
        msg = f"{repo} has been disabled on the Hugging Face Hub"
    elif isinstance(err, IncompleteSnapshotError):
        msg = (f"the cached copy of {repo} in {cache} is incomplete and the Hub cannot be "
               f"reached; run `mlxlocal pull {repo}` with network access")
    elif isinstance(err, LocalEntryNotFoundError) and offline:
        msg = (f"{repo} is not in the Hugging Face cache ({cache}) and offline mode is on "
               f"(HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE and run `mlxlocal pull {repo}`")
    elif isinstance(err, LocalEntryNotFoundError):
        msg = (f"{repo} is not in the Hugging Face cache ({cache}) and the Hub could not be "
               "reached; check your network connection (or HF_ENDPOINT) and retry")
    elif isinstance(err, HFValidationError):
        msg = f"{repo!r} is not a valid Hugging Face repo id ({err})"
    elif isinstance(err, HfHubHTTPError):
        msg = f"the Hugging Face Hub refused {repo}: {err}"
    else:
        msg = (f"could not download {repo} ({type(err).__name__}: {err}); check your network "
               "connection and retry")
    return ModelNotFoundError(msg)


def download(repo: str, revision: str | None = None, *, local_files_only: bool = False) -> Path:
    """Fetch the files a model needs into the Hub cache; return the snapshot directory.

    With HF_HUB_OFFLINE set (now, not only at import) only the cache is consulted.
    """
    from huggingface_hub import snapshot_download

    # errors.HTTPError is the HTTP client's base error (transport failures included).
    from huggingface_hub.errors import HTTPError

    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id=repo,
            revision=revision,
            cache_dir=str(hub_cache_dir()),
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline or local_files_only,
        )
    except (HTTPError, OSError, ValueError) as e:
        raise _hub_error(repo, revision, e, offline) from e
    return Path(path)


def _has_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _fetch(repo: str, revision: str | None) -> Path:
    """Cache first (no network if the snapshot is complete), then the Hub."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not hub_offline():
        try:
            path = download(repo, revision, local_files_only=True)
            if _has_weights(path):
                return path
        except ModelNotFoundError as e:
            if not isinstance(e.__cause__, LocalEntryNotFoundError):
                raise
    return download(repo, revision)


def _check_model_dir(path: Path, what: str) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} {path} has no config.json, so it is not a model directory")


def _not_found(spec: str) -> ModelNotFoundError:
    """One line: what the spec is not, the closest names we know, where the rest are listed."""
    catalog = load_catalog()
    known = [*catalog.aliases, *(f"synthetic:{n}" for n in catalog.synthetic)]
    with contextlib.suppress(Exception):  # the cache may be unreadable: suggestions only
        known += [m.repo_id for m in list_cached()]
    with contextlib.suppress(OSError):  # model directories next to where the user is
        known += [f"./{p.name}" for p in Path.cwd().iterdir() if (p / "config.json").is_file()]
    close = difflib.get_close_matches(spec, known, n=3, cutoff=0.6)
    close += [k for k in known if spec.lower() in k.lower() and k not in close][: 3 - len(close)]
    hint = (f" Did you mean {' or '.join(close)}?" if close
            else " Aliases look like qwen3-4b; synthetic:tiny needs no download.")
    return ModelNotFoundError(
        f"unknown model {spec!r}: not a local directory, catalog alias, synthetic:NAME or Hub repo id "
        f"(owner/name).{hint} `mlxlocal list --catalog` lists what there is."
    )


def _gguf_file(local: Path) -> Path | None:
    """A .gguf file, or a directory holding exactly one .gguf and no config.json."""
    if local.is_file():
        return local.resolve() if local.suffix.lower() == ".gguf" else None
    if local.is_dir() and not (local / "config.json").is_file():
        found = sorted(local.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:4])
            raise ModelLoadError(f"{local} holds {len(found)} .gguf files ({names}); "
                                 "pass the one to load")
    return None


def resolve(spec: str) -> ResolvedModel:
    """Find the model directory for a --model value.

    Order: `synthetic:` preset, existing local path, catalog alias, Hub repo id
    (`owner/name[@revision]`).
    """
    spec = spec.strip()
    if not spec:
        raise _not_found(spec)
    if synthetic.is_synthetic(spec):
        parsed = synthetic.parse_spec(spec)
        return ResolvedModel(synthetic.materialize(spec), "synthetic", parsed.canonical)

    local = Path(spec).expanduser()
    if local.exists():
        gguf = _gguf_file(local)
        if gguf is not None:
            return ResolvedModel(gguf, "local", gguf.stem)
        if not local.is_dir():
            raise ModelLoadError(f"{local} is a file; --model needs a model directory "
                                 "(config.json, *.safetensors, tokenizer files) or a .gguf file")
        _check_model_dir(local, "local directory")
        return ResolvedModel(local.resolve(), "local", local.resolve().name)

    if "/" not in spec:
        alias = load_catalog().find_alias(spec)
        if alias is not None:
            path = _fetch(alias.repo, None)
            _check_model_dir(path, f"{alias.repo} snapshot")
            return ResolvedModel(path, "alias", alias.name, alias.repo)
        raise _not_found(spec)

    repo, revision = _split_revision(spec)
    if looks_like_repo_id(repo):
        try:
            path = _fetch(repo, revision)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"{e} (and there is no local directory {spec!r})") from e
        _check_model_dir(path, f"{repo} snapshot")
        return ResolvedModel(path, "hub", repo, repo)
    raise _not_found(spec)


def pull(spec: str) -> ResolvedModel:
    """Download (or update) an alias or repo. Synthetic specs are materialised, which is
    their equivalent of a download; local directories have nothing to pull."""
    spec = spec.strip()
    if synthetic.is_synthetic(spec):
        return resolve(spec)
    if Path(spec).expanduser().exists():
        raise ModelNotFoundError(f"{spec!r} is a local directory; there is nothing to pull")
    alias = load_catalog().find_alias(spec) if "/" not in spec else None
    if alias is not None:
        path = download(alias.repo)
        _check_model_dir(path, f"{alias.repo} snapshot")
        return ResolvedModel(path, "alias", alias.name, alias.repo)
    repo, revision = _split_revision(spec)
    if not looks_like_repo_id(repo):
        raise _not_found(spec)
    path = download(repo, revision)
    _check_model_dir(path, f"{repo} snapshot")
    return ResolvedModel(path, "hub", repo, repo)


def _scan():
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return None


def list_cached() -> list[CachedModel]:
    """Models in the Hugging Face cache, newest first."""
    info = _scan()
    if info is None:
        return []
    models = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        main = next((r for r in revs if "main" in r.refs), revs[0])
        models.append(CachedModel(
            repo_id=repo.repo_id,
            size_bytes=repo.size_on_disk,
            nb_files=repo.nb_files,
            last_modified=repo.last_modified,
            revisions=tuple(r.commit_hash for r in revs),
            path=main.snapshot_path,
            has_config=(main.snapshot_path / "config.json").is_file(),
        ))
    return sorted(models, key=lambda m: m.last_modified, reverse=True)


def remove(repo_or_alias: str) -> int:
    """Delete every cached revision of a repo (or alias's repo); return bytes freed."""
    spec = repo_or_alias.strip()
    if synthetic.is_synthetic(spec):
        return synthetic.remove_materialized(spec)
    alias = load_catalog().find_alias(spec) if "/" not in spec else None
    repo = alias.repo if alias else _split_revision(spec)[0]
    info = _scan()
    cached = None
    if info is not None:
        cached = next((r for r in info.repos if r.repo_type == "model"
                       and r.repo_id.lower() == repo.lower()), None)
    if cached is None:
        raise ModelNotFoundError(
            f"{repo} is not in the Hugging Face cache ({hub_cache_dir()}); "
            "`mlxlocal list` shows what is cached"
        )
    strategy = info.delete_revisions(*(r.commit_hash for r in cached.revisions))
    freed = strategy.expected_freed_size
    strategy.execute()
    return freed

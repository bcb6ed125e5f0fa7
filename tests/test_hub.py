"""hub.resolve / download / list_cached / remove and the model CLI commands, against a
fake Hugging Face cache in tmp_path. HF_HUB_OFFLINE=1: nothing here touches the network."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import huggingface_hub
import pytest
import typer
from typer.testing import CliRunner

from mlxlocal.cli import models as cli_models
from mlxlocal.errors import ModelLoadError, ModelNotFoundError
from mlxlocal.source import hub, synthetic

REPO = "mlx-community/Qwen3-0.6B-4bit"  # what the `qwen3-0.6b` alias points at
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return synthetic.materialize("synthetic:tiny:fp32", tmp_path_factory.mktemp("syn"))


@pytest.fixture
def hf_env(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path / "mlxlocal"))
    return cache


def add_to_cache(cache: Path, repo: str, src: Path, commit: str = COMMIT) -> Path:
    """Copy a model dir into the real hub cache layout: blobs + snapshot symlinks + refs."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def test_cache_location_and_offline_are_read_at_call_time(hf_env, monkeypatch):
    assert hub.hub_cache_dir() == hf_env
    assert hub.hub_offline()
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hub.hub_cache_dir() == hf_env  # from HF_HOME
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.hub_offline()


def test_resolve_alias_and_repo_from_cache(hf_env, tiny_model_dir):
    import mlx_lm

    snapshot = add_to_cache(hf_env, REPO, tiny_model_dir)
    by_alias = hub.resolve("qwen3:0.6b")
    assert by_alias == hub.ResolvedModel(snapshot, "alias", "qwen3-0.6b", REPO)
    by_repo = hub.resolve(REPO)
    assert (by_repo.path, by_repo.source, by_repo.repo) == (snapshot, "hub", REPO)
    model, tok = mlx_lm.load(str(by_repo.path))  # the snapshot is a usable model
    assert tok.eos_token_id is not None


def test_resolve_checks_the_cache_before_the_network(hf_env, tiny_model_dir, monkeypatch):
    add_to_cache(hf_env, REPO, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs["local_files_only"])
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    assert hub.resolve(REPO).source == "hub"
    assert calls == [True]


def test_uncached_repo_offline_is_a_clear_error(hf_env):
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="offline") as err:
        hub.resolve("someone/not-cached-model")
    assert "HF_HUB_OFFLINE" in str(err.value) and "not-cached-model" in str(err.value)
    with pytest.raises(ModelNotFoundError, match="offline"):
        hub.resolve("mistral-7b")  # alias whose repo is not cached
    with pytest.raises(ModelNotFoundError, match="offline"):
        hub.pull("someone/not-cached-model")
    assert time.monotonic() - start < 10


def test_unknown_spec_suggests_list_aliases_and_presets(hf_env):
    with pytest.raises(ModelNotFoundError) as err:
        hub.resolve("definitely-not-a-model")
    msg = str(err.value)
    # One short line: where the names are listed, and what one looks like.
    assert "mlxlocal list --catalog" in msg and "synthetic:tiny" in msg and "qwen3-4b" in msg
    assert len(msg) < 300 and "\n" not in msg
    with pytest.raises(ModelNotFoundError, match="Did you mean qwen3-0.6b"):
        hub.resolve("qwen3-0.6")


def test_local_directory(hf_env, tmp_path, tiny_model_dir):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json") as err:
        hub.resolve(str(empty))
    assert str(empty) in str(err.value)
    resolved = hub.resolve(str(tiny_model_dir))
    assert resolved.source == "local" and resolved.path == tiny_model_dir.resolve()
    with pytest.raises(ModelNotFoundError, match="nothing to pull"):
        hub.pull(str(tiny_model_dir))
    weights = tiny_model_dir / "model.safetensors"
    with pytest.raises(ModelLoadError, match="is a file"):
        hub.resolve(str(weights))


def test_resolve_synthetic_materializes_under_mlxlocal_home(hf_env, tmp_path):
    resolved = hub.resolve("synthetic:tiny:fp32:seed=4")
    assert resolved.source == "synthetic" and resolved.repo is None
    assert resolved.name == "synthetic:tiny:fp32:seed=4"
    assert resolved.path.parent == tmp_path / "mlxlocal" / "synthetic"
    assert (resolved.path / "config.json").is_file()
    with pytest.raises(ModelNotFoundError, match="unknown synthetic preset"):
        hub.resolve("synthetic:gpt-17")


def test_list_and_remove(hf_env, tiny_model_dir):
    assert hub.list_cached() == []
    snapshot = add_to_cache(hf_env, REPO, tiny_model_dir)
    size = sum(f.stat().st_size for f in (hf_env / ("models--" + REPO.replace("/", "--")) /
                                          "blobs").iterdir())
    [cached] = hub.list_cached()
    assert cached.repo_id == REPO and cached.size_bytes == size
    assert cached.path == snapshot and cached.has_config
    assert cached.revisions == (COMMIT,) and cached.nb_files >= 5
    assert hub.pull("qwen3-0.6b").path == snapshot  # offline pull: served from the cache

    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        hub.remove("someone/other-model")
    assert hub.remove("qwen3:0.6b") == size
    assert hub.list_cached() == []
    assert not snapshot.exists()


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli() -> tuple[typer.Typer, CliRunner]:
    app = typer.Typer()
    cli_models.register(app)
    return app, CliRunner()


def test_cli_list_pull_rm(hf_env, tiny_model_dir, cli):
    app, runner = cli
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0 and "No models downloaded" in result.output
    add_to_cache(hf_env, REPO, tiny_model_dir)
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    assert REPO in result.output and "qwen3-0.6b" in result.output and "MB" in result.output

    result = runner.invoke(app, ["list", "--catalog"])
    assert result.exit_code == 0
    assert "Catalog aliases" in result.output and "mistral-nemo" in result.output
    assert "Synthetic presets" in result.output and "qwen2.5-7b" in result.output

    result = runner.invoke(app, ["pull", "qwen3-0.6b"])
    assert result.exit_code == 0 and "ready" in result.output

    result = runner.invoke(app, ["rm", REPO], input="n\n")
    assert result.exit_code == 1 and "aborted" in result.stderr
    result = runner.invoke(app, ["rm", REPO, "--yes"])
    assert result.exit_code == 0 and "freed" in result.output
    assert hub.list_cached() == []


def test_cli_errors_are_one_red_line(hf_env, cli):
    app, runner = cli
    for args in (["rm", "someone/missing", "-y"], ["pull", "someone/missing"],
                 ["pull", "no-such-alias"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, args
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.exception is None or isinstance(result.exception, SystemExit)

"""Tiny random-weight models in the HF layout, built once per test session."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

# Never reach for the network from tests; keep state out of the user's home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a Mac the kernel tests call the dispatch functions to run our kernels: under auto the
# chooser could pick MLX's built-in instead (and write its cache into the user's home).
os.environ.setdefault("MLXLOCAL_KERNELS", "ours")

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    vocab_size=384,
    max_position_embeddings=512,
)

# One config per native family, each exercising the family's distinct math.
FAMILY_CONFIGS = {
    # llama3 rope scaling, untied head. Written transformers-4 style (top-level rope_theta /
    # rope_scaling) because mlx-lm 0.32's llama ignores transformers-5 `rope_parameters`.
    "llama": dict(
        BASE, model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "mistral": dict(BASE, model_type="mistral", tie_word_embeddings=False, rope_theta=1e6, sliding_window=None),
    # q/k/v biases.
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    # per-head q/k norms, tied embeddings; transformers-5 style rope_parameters.
    "qwen3": dict(BASE, model_type="qwen3", tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
# Models that run mlx-lm's model code on the paged engine: gemma3 alternates sliding-window
# (32 tokens, shorter than the tests' prompts) and global layers; nemotron_h is a hybrid of
# Mamba-2 (recurrent state), attention and MLP layers.
MLX_LM_CONFIGS = {
    "gemma3": dict(BASE, model_type="gemma3_text", sliding_window=32, sliding_window_pattern=2,
                   query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4),
    "hybrid": dict(
        model_type="nemotron_h", vocab_size=384, hidden_size=64, intermediate_size=128,
        max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=False, mamba_num_heads=8, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "M", "-"]),
}
TEMPLATES = {"llama": "llama3", "mistral": "mistral", "qwen2": "chatml", "qwen3": "chatml"}


def build_tiny(path: Path, config: dict, *, template: str = "chatml", bits: int | None = None, seed: int = 0) -> Path:
    from mlxlocal.source.synthetic.weights import write_model_dir

    return write_model_dir(path, dict(config), seed=seed, dtype="float32", quantize_bits=bits, chat_template=template)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: build_tiny(root / family, cfg, template=TEMPLATES[family])
        for family, cfg in FAMILY_CONFIGS.items()
    }


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def gemma_model(tmp_path_factory) -> Path:
    """A model on the mlx-lm path (gemma has no native implementation: mlx-lm's model code on
    the paged engine), with the tiny models' 512-token context."""
    return build_tiny(tmp_path_factory.mktemp("gemma") / "gemma", dict(BASE, model_type="gemma", rope_theta=10000.0))


@pytest.fixture(scope="session")
def mlx_lm_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx_lm_models")
    return {name: build_tiny(root / name, cfg) for name, cfg in MLX_LM_CONFIGS.items()}


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory) -> Path:
    """A tiny model with a 64k context and a 4k vocabulary: agent clients' system prompts and
    tool schemas (tens of thousands of tokens) fit."""
    return build_tiny(tmp_path_factory.mktemp("agent") / "qwen3",
                      dict(FAMILY_CONFIGS["qwen3"], vocab_size=4096, max_position_embeddings=65536))


@pytest.fixture(scope="module")
def server(tiny_model):
    """`mlxlocal serve` on the tiny qwen3 model, on loopback: (base URL, app). One per module."""
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    with running_server(ServerConfig(models=[str(tiny_model)])) as (url, app):
        yield url, app


@pytest.fixture
def doomed_scheduler(monkeypatch):
    """Arm it with an engine's scheduler: that engine's loop then raises outside any request
    (the engine dies), to test that nothing waits on it forever."""
    from mlxlocal.engine.scheduler import Scheduler

    doomed: list[Scheduler] = []
    original = Scheduler.has_work

    def has_work(self):
        if self in doomed:
            raise RuntimeError("injected loop fault")
        return original.fget(self)

    monkeypatch.setattr(Scheduler, "has_work", property(has_work))
    return doomed


# Fixtures that start `mlxlocal` as a subprocess (a pty for chat): such tests are `slow`,
# left out of the quick subset (`python -m pytest -m "not slow"`) like modules marked slow.
SUBPROCESS_FIXTURES = {"chat", "home"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SUBPROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def wait_for(pred, timeout: float = 10.0) -> bool:
    """Poll `pred` until it holds (engine threads settle asynchronously) or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason ("444 skipped: needs Metal (Apple Silicon)"), so a wall of
    `s` in the progress line explains itself."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n} skipped: {reason}")

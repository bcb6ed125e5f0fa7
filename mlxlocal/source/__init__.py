"""Where a model comes from: a --model spec resolved to a directory and loaded.

catalog.py   models.toml: aliases and synthetic presets
hub.py       spec -> directory: local path, alias, Hugging Face repo, synthetic:NAME;
             pull / list / rm on the Hugging Face cache
synthetic/   synthetic:NAME -> a Hugging Face-layout directory with random weights
loader.py    spec -> LoadedModel (model, tokenizer, config, ModelInfo, ChatFormat)
chat_format.py  the tokenizer's chat format (template, tool / think markers, special
             tokens), read once at load: the only place tokenizer attributes are probed

Nothing is imported here: the engine imports loader types, and hub pulls in
huggingface_hub, which is slow to import.
"""

"""Data side: the user's data (`config.DataSpec`, `source.load_data` -> PromptSources of `Example`s; files read
by `files` with HF datasets; reasoning_gym streams and the tiny model's formats in `procedural`), the legacy
reasoning_gym `tasks` the runner still uses, tokenizers (`tokenizer`), and the offline SmolLM2 checkpoint
converter (`smollm2`). Submodules are imported explicitly: `tasks`/`procedural` pull in reasoning_gym, `files`
pulls in datasets, `smollm2` pulls in transformers, and none should load for a tokenizer alone."""

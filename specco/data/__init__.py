"""Data side: reasoning_gym tasks and rewards (`tasks`), tokenizers (`tokenizer`), and the offline
SmolLM2 checkpoint converter (`smollm2`). Submodules are imported explicitly: `tasks` pulls in
reasoning_gym, `smollm2` pulls in transformers, and neither should load for a tokenizer alone."""

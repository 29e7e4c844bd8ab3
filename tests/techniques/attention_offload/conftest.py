from tests.agents.conftest import tiny_llama_dir, tiny_model_dirs  # noqa: F401  (the tiny checkpoints)

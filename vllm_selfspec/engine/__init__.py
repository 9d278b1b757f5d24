"""The engine: runs the drafts inside vLLM's model runner. Every vLLM internal it touches goes
through compat.py (the import-linter contracts in pyproject.toml hold it to that); plugin.py and
metrics.py are the other places that meet vLLM at run time."""

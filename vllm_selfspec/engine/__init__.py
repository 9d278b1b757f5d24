"""The engine: the only code that touches vLLM at run time (see compat.py for the internals)."""

"""Helpers shared by the engine tests (importable thanks to pytest.ini's pythonpath)."""
from __future__ import annotations

import contextlib
import gc

#: the engine settings every parity comparison shares (vanilla and self-spec alike)
ENGINE_KW = dict(dtype="float32", enforce_eager=True, max_model_len=2048,
                 gpu_memory_utilization=0.3, seed=0, disable_log_stats=False)


@contextlib.contextmanager
def engine(model: str, **kw):
    """A vllm.LLM that is shut down (and its memory freed) when the block ends."""
    from vllm import LLM

    llm = LLM(model=model, **{**ENGINE_KW, **kw})
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]

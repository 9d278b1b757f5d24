"""Run by tests/engine/test_tp.py in a subprocess (PYTHONPATH: tests/ray_cpu, see its
sitecustomize): vanilla vLLM and selfspec with vLLM's own Ray executor, TP=2, greedy, on the
tiny model at argv[1]; writes their tokens, selfspec's stats and what each of selfspec's workers
says it is (asked by ``collective_rpc``, not read from Ray's forwarded logs, which may come late)
as JSON to argv[2]."""

import json
import os
import sys

if __name__ == "__main__":
    import ray

    ray.init(num_cpus=2, include_dashboard=False, resources={"vllm_cpu": 2})
    # the engine core process connects to this cluster instead of starting its own
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    # collective_rpc below sends a function to the engine core process
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams

    import vllm_selfspec

    model, out = sys.argv[1], sys.argv[2]
    kw = dict(
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        skip_tokenizer_init=True,
        seed=0,
    )
    spec = {"method": "layerskip", "exit_layer": 2, "num_speculative_tokens": 3, "goodput": False}
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 17 + 2 * i, 33]} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result = {}
    for name, extra in (("vanilla", {}), ("selfspec", {"speculative_config": spec})):
        llm = LLM(model=model, **kw, **extra)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        if extra:
            result["stats"] = vllm_selfspec.get_stats(llm)
            result["executor"] = type(llm.llm_engine.engine_core).__name__
            result["workers"] = llm.collective_rpc(
                lambda w: {
                    "ray_actor": ray.get_runtime_context().get_actor_id(),
                    "rank": w.rank,
                    "worker": type(w.worker).__name__,
                    "selfspec_runner": any(
                        c.__name__ == "SelfSpecRunnerMixin"
                        for c in type(w.worker.model_runner).__mro__
                    ),
                    "pid": os.getpid(),
                }
            )
        llm.llm_engine.engine_core.shutdown()
        del llm
    with open(out, "w") as f:
        json.dump(result, f, default=str)
    ray.shutdown()

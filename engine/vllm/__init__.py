"""batchtop inside vLLM: a scheduler class that turns vLLM's decisions into batchtop's events, its
side endpoint, and a launcher for vLLM servers.

`scheduler` and `endpoint` run inside vLLM's engine process, `harness` (vLLM's scheduler on a virtual
clock) and `check` in vLLM's interpreter: they import only `batchtop.telemetry` and what vLLM itself
installs. `launch` and `commands` (`batchtop vllm serve`, `batchtop vllm check`) run on batchtop's side.
"""

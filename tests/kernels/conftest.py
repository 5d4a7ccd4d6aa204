"""Run the Triton kernels through the interpreter so these tests need no GPU.

triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
batchtop.kernels.attention_triton is imported, so it is set here, before any test module
imports it. Should something have imported it earlier without the flag, it is reloaded.
"""

import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")      # a GPU run sets 0 (test_attention_cuda.py)

_triton_module = sys.modules.get("batchtop.kernels.attention_triton")
if _triton_module is not None and _triton_module.INTERPRET != (os.environ["TRITON_INTERPRET"] == "1"):
    importlib.reload(_triton_module)

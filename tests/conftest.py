"""Suite-wide set-up that must happen before anything imports triton (and a scratch folder for crash logs).

triton reads TRITON_INTERPRET when it is first imported (its own standard library is jitted
then), and transformers or torch may import it long before tests/kernels runs. With the flag
set here the Triton kernels run through the interpreter on the CPU; the engine's CPU path
never uses Triton, so nothing else changes. On a GPU machine, TRITON_INTERPRET=0 runs the CUDA
tests (test_attention_cuda.py, test_engine_cuda.py) on compiled kernels.
"""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")      # a GPU run sets 0 to run them compiled
# Crash logs of the flight recorder (telemetry/flight.py) go to a scratch folder, not the user's cache.
os.environ.setdefault("BATCHTOP_FLIGHT_DIR", tempfile.mkdtemp(prefix="batchtop-flight-"))

"""Suite-wide set-up that must happen before anything imports triton.

triton reads TRITON_INTERPRET when it is first imported (its own standard library is jitted
then), and transformers or torch may import it long before tests/kernels runs. With the flag
set here the Triton kernels run through the interpreter on the CPU; the engine's CPU path
never uses Triton, so nothing else changes.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

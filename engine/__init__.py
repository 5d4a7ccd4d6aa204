"""batchtop's engine.

The repository root holds batchtop's packages as folders (engine/, kernels/, telemetry/, tui/) that
pyproject maps under `batchtop.`. Run from the root (`python -m batchtop...`, `python -m pytest`),
Python puts the root on sys.path, and the folders become top-level modules as well: `kernels` would
then shadow Hugging Face's package of that name, which transformers imports when it loads. Nothing
imports batchtop's folders by those bare names, so the root comes off sys.path here, before anything
of the engine imports transformers.
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _ROOT]

"""The modules of benchmarks/, imported for their tests as the benchmarks' entry points import them."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py, imported as `python benchmarks/learning_efficiency.py` imports it: with its
    folder first on sys.path, so that the modules beside it import by name."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))

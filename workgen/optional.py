"""The optional packages some dataset formats need (the `crowdtrain[data]` extra), imported when a
job first uses them, with an error that says what to install."""

import importlib
from types import ModuleType

EXTRA = "crowdtrain[data]"


def require(module: str, fmt: str) -> ModuleType:
    """`module`, imported; ValueError (a 422 to the operator) naming the format and the extra if missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ValueError(
            f"dataset.source: {fmt} datasets need the {package} package, which this scheduler lacks: install {EXTRA}"
        ) from None

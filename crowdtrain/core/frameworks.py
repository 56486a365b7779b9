"""Which deep-learning framework can run which model: shared by the scheduler, the parameter
servers and the client, and importing no framework itself.

Zoo models have one canonical parameter layout (the PyTorch zoo's `state_dict`), so any framework
that ports a zoo model can train a job of either framework. A Keras-JSON model exists only in Keras.
"""

import importlib.util
from collections.abc import Collection
from typing import Any, Literal, TypeGuard

Framework = Literal["pytorch", "tensorflow"]
FRAMEWORKS: tuple[Framework, ...] = ("pytorch", "tensorflow")
KERAS_MODEL = "keras"  # model.name of a job whose model is a Keras model JSON
# Zoo models each framework has a port of (crowdtrain/zoo.py, crowdtrain/zoo_keras.py).
ZOO_PORTS = {"pytorch": frozenset({"mlp", "cnn1d", "resnet", "moe"}), "tensorflow": frozenset({"mlp", "cnn1d"})}
_MODULES = {"pytorch": "torch", "tensorflow": "tensorflow"}


def installed() -> list[Framework]:
    """The frameworks importable in this environment, PyTorch first."""
    return [f for f in FRAMEWORKS if importlib.util.find_spec(_MODULES[f]) is not None]


def is_framework(name: str) -> TypeGuard[Framework]:
    """Whether `name` is one of FRAMEWORKS."""
    return name in FRAMEWORKS


def job_framework(model_config: dict[str, Any]) -> str:
    """The framework a job was submitted for (jobs from before frameworks existed are PyTorch)."""
    framework: str = model_config.get("framework", "pytorch")
    return framework


def able_to_run(model_config: dict[str, Any]) -> list[str]:
    """Frameworks that can train `model_config`, the job's own framework first."""
    name, own = model_config["name"], job_framework(model_config)
    if name == KERAS_MODEL:
        return ["tensorflow"]
    able = [f for f in FRAMEWORKS if name in ZOO_PORTS[f]]
    return sorted(able, key=lambda f: f != own)


def pick(model_config: dict[str, Any], have: Collection[str]) -> str | None:
    """The framework to train `model_config` with, among `have`: the job's own if possible."""
    return next((f for f in able_to_run(model_config) if f in have), None)


def runs_on(model_config: dict[str, Any], host_frameworks: str) -> bool:
    """Whether one of the frameworks a host declared (comma-separated, as the ledger keeps them)
    trains `model_config` (a Keras JSON model needs TensorFlow; a zoo model, any framework with a
    port of it)."""
    return pick(model_config, host_frameworks.split(",")) is not None

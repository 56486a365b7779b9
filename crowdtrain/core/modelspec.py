"""The model section of a job spec: a zoo model and the keyword options of its builder (bounded so
that it can be built at all), or a Keras model's JSON config."""

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, ValidationError, model_validator

from crowdtrain.core.frameworks import KERAS_MODEL
from crowdtrain.core.specfile import SpecSection

ZOO_MODELS = ("mlp", "cnn1d", "resnet", "moe")

# Bounds that keep a zoo model buildable at all; whether it fits the upload limit is checked at
# submission by building it without memory (crowdtrain.core.zoo.check_model).
MAX_WIDTH = 65_536
MAX_DEPTH = 64
# Builder arguments the scheduler sets itself, never options, and where each comes from.
BUILDER_ARGUMENTS = {
    "seed": "the job's top-level seed",
    "name": "model.name",
    "input_shape": "the dataset's examples",
    "num_classes": "the dataset's labels (dataset.classes)",
    "layout": "the job's experts section (mode moe)",
}
MAX_KERAS_JSON_BYTES = 8 * 1024 * 1024  # a spec file's `model.keras_file`


class MLPOptions(SpecSection):
    hidden: list[Annotated[StrictInt, Field(ge=1, le=MAX_WIDTH)]] = Field(
        [256, 256], max_length=MAX_DEPTH, description="Hidden layer widths"
    )


class CNN1DOptions(SpecSection):
    channels: StrictInt = Field(32, ge=1, le=MAX_WIDTH)
    kernel_size: StrictInt = Field(5, ge=1, le=4096)
    layers: StrictInt = Field(3, ge=1, le=MAX_DEPTH, description="Each but the last halves the length")


class ResNetOptions(SpecSection):
    width: StrictInt = Field(16, ge=1, le=MAX_WIDTH)
    blocks: StrictInt = Field(2, ge=1, le=MAX_DEPTH)


class MoeOptions(SpecSection):
    """The trunk of a mixture-of-experts model (mode moe) takes its shape from the job's experts section."""


# The keyword options of each zoo builder (crowdtrain.core.zoo, crowdtrain.core.zoo_keras); a test keeps
# these in step with the builders' signatures.
ZOO_OPTIONS: dict[str, type[SpecSection]] = {
    "mlp": MLPOptions,
    "cnn1d": CNN1DOptions,
    "resnet": ResNetOptions,
    "moe": MoeOptions,
}


def check_zoo_options(model: str, options: dict[str, Any]) -> None:
    """Raise ValueError naming `model.options.KEY` and the problem, for options the builder of
    `model` cannot take: an argument the scheduler sets itself, an unknown key, a bad value."""
    schema = ZOO_OPTIONS[model]
    for key in options:
        if key in BUILDER_ARGUMENTS:
            raise ValueError(
                f"model.options.{key}: not an option of {model!r}: the scheduler sets it from {BUILDER_ARGUMENTS[key]}"
            )
        if key not in schema.model_fields:
            raise ValueError(
                f"model.options.{key}: not an option of {model!r}; it takes {', '.join(schema.model_fields)}"
            )
    try:
        schema.model_validate(options)
    except ValidationError as exc:
        raise ValueError(
            "; ".join(
                f"model.options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
            )
        ) from None


class ModelSpec(SpecSection):
    name: Literal["mlp", "cnn1d", "resnet", "moe", "keras"] = Field(
        ...,
        description="A zoo model ('moe': the dense trunk of mode moe, shaped by the experts section), or "
        "'keras' for the Keras model JSON given in `keras`",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the zoo builder")
    keras: dict[str, Any] | None = Field(
        None,
        description="A Keras model's JSON config (`model.to_json()`), loaded in safe mode: no Lambda layers "
        "or other code. It must output logits. In a spec file, `keras_file: PATH` reads it.",
    )

    @model_validator(mode="after")
    def _keras_json_with_keras_name(self) -> "ModelSpec":
        if (self.name == KERAS_MODEL) != (self.keras is not None):
            raise ValueError("model.keras (a Keras model JSON) is given exactly when model.name is 'keras'")
        if self.keras is not None and self.options:
            raise ValueError("model.options are for zoo models; a Keras JSON model has its settings inside")
        if self.name in ZOO_OPTIONS:
            check_zoo_options(self.name, self.options)
        return self

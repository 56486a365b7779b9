"""The model section of a job spec (crowdtrain.core.modelspec); how a whole spec refuses a bad model
section is in test_jobspec.py."""

import inspect

from crowdtrain.core import zoo, zoo_keras
from crowdtrain.core.modelspec import BUILDER_ARGUMENTS, ZOO_OPTIONS


def test_the_option_schemas_are_the_zoo_builders_keyword_arguments() -> None:
    builders = {
        **{(n, "pytorch"): b for n, b in zoo._BUILDERS.items()},
        **{(n, "tensorflow"): b for n, b in zoo_keras._BUILDERS.items()},
    }
    for (name, _), builder in builders.items():
        params = inspect.signature(builder).parameters
        assert list(params)[:2] == ["input_shape", "num_classes"]
        options = [(k, p) for k, p in list(params.items())[2:] if k not in BUILDER_ARGUMENTS]
        assert [k for k, _ in options] == list(ZOO_OPTIONS[name].model_fields), name
        defaults = ZOO_OPTIONS[name]().model_dump()
        assert {k: p.default for k, p in options} == {
            k: tuple(v) if isinstance(v, list) else v for k, v in defaults.items()
        }, name
    assert {"input_shape", "num_classes"} <= set(BUILDER_ARGUMENTS)

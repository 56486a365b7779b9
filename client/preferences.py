"""The volunteer's preferences: one pydantic model, read from a TOML file, overridden on the command line.

The file (default `~/.config/crowdtrain/client.toml`) holds top-level keys named like the fields:

    tasks = 2
    device = "auto"
    idle_only = true
    idle_minutes = 5
    cache_max_bytes = "20GB"
    daily_download_bytes = "5GB"
    download_origins = ["https://s3.example.org"]
    account = "alice"

Every field is also a `crowdtrain client` option (`--idle-minutes 5`), which wins over the file.
Byte sizes and rates (bytes/s) are integers or strings with a unit (`500MB`, `2GiB`).
"""

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, IPvAnyAddress, ValidationError

from crowdtrain.client.origins import parse_origin

DEFAULT_PATH = Path("~/.config/crowdtrain/client.toml")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class PreferencesError(ValueError):
    """A preferences file or option that cannot be used; the message names the field and its source."""


def parse_bytes(value: Any) -> Any:
    """`"1.5GB"` -> 1500000000; integers and None pass through for pydantic to check."""
    if not isinstance(value, str):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a byte size (e.g. 500MB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


ByteSize = Annotated[int | None, BeforeValidator(parse_bytes), Field(ge=0)]
ByteRate = Annotated[int | None, BeforeValidator(parse_bytes), Field(gt=0)]
DownloadOrigin = Annotated[str, AfterValidator(parse_origin)]


class Preferences(BaseModel):
    """What the volunteer allows the client to do. None for a limit means no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: int = Field(1, ge=1, le=64, description="Assignments run at once")
    threads: int | None = Field(None, ge=1, description="CPU threads for training (default: the framework's)")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or mps")
    idle_only: bool = Field(False, description="Work only while the machine is idle")
    idle_minutes: float = Field(3.0, gt=0, description="Idle means no input and low CPU use by others this long")
    idle_cpu_percent: float = Field(
        25.0, gt=0, le=100, description="CPU use by other processes (% of all cores) that counts as busy"
    )
    cache_max_bytes: ByteSize = Field(None, description="Disk for cached shards and snapshots together")
    daily_download_bytes: ByteSize = Field(None, description="Bytes downloaded per UTC day")
    daily_upload_bytes: ByteSize = Field(None, description="Bytes uploaded per UTC day")
    max_download_rate: ByteRate = Field(None, description="Download bandwidth, bytes/s")
    max_upload_rate: ByteRate = Field(None, description="Upload bandwidth, bytes/s")
    account: str = Field(
        "",
        max_length=64,
        pattern=r"^[A-Za-z0-9 ._@+-]*$",
        description="Volunteer account this host's credit adds up under on the project page (given at registration)",
    )
    bind_address: IPvAnyAddress | None = Field(
        None,
        description="Local address to send requests from (a machine with several; hosts on one machine, bound to "
        "127.0.1.1, 127.0.2.1, .., count as separate networks for replica spread)",
    )
    download_origins: list[DownloadOrigin] = Field(
        default_factory=list,
        max_length=32,
        description="Object stores (scheme://host:port) downloads may come from, besides the scheduler and the "
        "store it names at registration",
    )


OPTION_NAMES = {"download_origins": "--allow-origin"}  # a repeated option, one origin each


def option_name(field: str) -> str:
    return OPTION_NAMES.get(field, "--" + field.replace("_", "-"))


def read_file(path: Path, required: bool) -> dict[str, Any]:
    """The TOML file's keys; a missing default file is an empty one, a missing named file an error."""
    path = path.expanduser()
    if not path.is_file():
        if required:
            raise PreferencesError(f"preferences file {path} does not exist")
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PreferencesError(f"preferences file {path} is not valid TOML: {exc}") from None


def load_preferences(path: Path | None, overrides: dict[str, Any]) -> Preferences:
    """The file at `path` (default DEFAULT_PATH) with the non-None `overrides` on top."""
    source = path or DEFAULT_PATH
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = {**read_file(source, required=path is not None), **given}
    try:
        return Preferences.model_validate(merged)
    except ValidationError as exc:
        raise PreferencesError(_explain(exc, given, source.expanduser())) from None


def _explain(exc: ValidationError, given: dict[str, Any], source: Path) -> str:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        where = option_name(field) if field in given else str(source)
        message = "unknown preference" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"invalid preference `{field}` (from {where}): {message}")
    return "\n".join(lines)


def template() -> str:
    """A preferences file that sets nothing: every field commented out with its description and default."""
    lines = [
        "# Preferences of the crowdtrain volunteer client, read when it starts (restart it after an edit).",
        "# Uncomment a key to set it; each is also a `crowdtrain client` option, which wins over this file.",
        "# Byte sizes and rates (bytes/s) take a unit: 500MB, 2GiB.",
    ]
    for name, info in Preferences.model_fields.items():
        default = info.get_default(call_default_factory=True)
        value = "" if default is None else " " + json.dumps(default)
        lines += ["", f"# {info.description}", f"# {name} ={value}"]
    return "\n".join(lines) + "\n"

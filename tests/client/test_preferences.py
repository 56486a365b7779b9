"""Preferences: the TOML file, command-line overrides on top, and errors that name the field."""

import subprocess
from pathlib import Path

import pytest

from crowdtrain.client.preferences import Preferences, PreferencesError, load_preferences
from crowdtrain.launch.cluster import crowdtrain_argv

FILE = """
tasks = 3
device = "cpu"
idle_only = true
idle_minutes = 0.5
cache_max_bytes = "2GiB"
daily_download_bytes = 5000000
"""


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch) -> Path:
    """A HOME of its own, so that the default file of whoever runs the tests is never read."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.toml"
    path.write_text(text)
    return path


def test_the_file_is_read_and_sizes_take_units(tmp_path: Path) -> None:
    prefs = load_preferences(write(tmp_path, FILE), {})
    assert (prefs.tasks, prefs.device, prefs.idle_only, prefs.idle_minutes) == (3, "cpu", True, 0.5)
    assert (prefs.cache_max_bytes, prefs.daily_download_bytes, prefs.daily_upload_bytes) == (2 * 2**30, 5_000_000, None)


def test_options_override_the_file_and_unset_options_do_not(tmp_path: Path) -> None:
    prefs = load_preferences(
        write(tmp_path, FILE), {"tasks": 1, "idle_only": False, "threads": None, "cache_max_bytes": "100MB"}
    )
    assert (prefs.tasks, prefs.idle_only, prefs.cache_max_bytes) == (1, False, 100_000_000)
    assert prefs.idle_minutes == 0.5, "a preference not given on the command line comes from the file"


def test_a_missing_default_file_means_defaults() -> None:
    assert load_preferences(None, {}) == Preferences()


def test_the_default_file_is_read_from_the_users_config_directory(home: Path) -> None:
    (home / ".config" / "crowdtrain").mkdir(parents=True)
    (home / ".config" / "crowdtrain" / "client.toml").write_text("tasks = 5\n")
    assert load_preferences(None, {}).tasks == 5


@pytest.mark.parametrize(
    ("text", "overrides", "says"),
    [
        ("idle_minutes = -1\n", {}, "invalid preference `idle_minutes` (from {file}): Input should be greater than 0"),
        ("", {"idle_minutes": -1}, "invalid preference `idle_minutes` (from --idle-minutes)"),
        ("cache_max_bytes = 'lots'\n", {}, "invalid preference `cache_max_bytes` (from {file})"),
        ("tasks = 0\n", {}, "invalid preference `tasks`"),
        ("idel_only = true\n", {}, "invalid preference `idel_only` (from {file}): unknown preference"),
        ("tasks = \n", {}, "is not valid TOML"),
        (
            "download_origins = ['https://s3.example.org/bucket']\n",
            {},
            "invalid preference `download_origins` (from {file})",
        ),
        (
            "",
            {"download_origins": ["ftp://s3.example.org"]},
            "invalid preference `download_origins` (from --allow-origin)",
        ),
    ],
)
def test_a_bad_file_or_value_names_the_field_and_its_source(
    tmp_path: Path, text: str, overrides: dict, says: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PreferencesError) as err:
        load_preferences(path, overrides)
    assert says.format(file=path) in str(err.value)


def test_allowed_download_origins_are_read_as_origins(tmp_path: Path) -> None:
    prefs = load_preferences(write(tmp_path, "download_origins = ['HTTPS://S3.example.org']\n"), {})
    assert prefs.download_origins == ["https://s3.example.org:443"]


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PreferencesError, match="does not exist"):
        load_preferences(tmp_path / "nope.toml", {})


def test_the_client_command_exits_2_naming_the_bad_field(tmp_path: Path) -> None:
    path = write(tmp_path, "daily_upload_bytes = '12 parsecs'\n")
    proc = subprocess.run(
        crowdtrain_argv(
            "client",
            "--server",
            "http://127.0.0.1:9",
            "--join-token",
            "t",
            "--cache",
            str(tmp_path / "cache"),
            "--config",
            str(path),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"invalid preference `daily_upload_bytes` (from {path})" in proc.stderr


@pytest.mark.parametrize(
    ("text", "value"), [("12500000.0", 12_500_000), ("1e7", 10_000_000), ("2MB", 2_000_000), ("1 KiB", 1024), (3, 3)]
)
def test_rates_and_sizes_accept_plain_numbers_floats_and_units(text, value) -> None:
    assert load_preferences(None, {"max_download_rate": text}).max_download_rate == value


def test_a_zero_rate_is_refused_rather_than_read_as_no_limit() -> None:
    with pytest.raises(PreferencesError, match="`max_upload_rate` \\(from --max-upload-rate\\)"):
        load_preferences(None, {"max_upload_rate": "0"})

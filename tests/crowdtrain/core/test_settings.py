"""The scheduler's secrets: it refuses to start without an admin token or with a published one."""

import math
import os
import secrets
import subprocess

import pytest

from crowdtrain.core.settings import (
    MIN_TOKEN_BITS,
    InsecureSettings,
    Settings,
    check_secrets,
    get_settings,
    secrets_problems,
    token_entropy_bits,
)
from crowdtrain.launch.cluster import crowdtrain_argv, free_port

GOOD = "Zx1r3FQ0d0kP2w9yq2m8sQ"


@pytest.mark.parametrize(
    ("admin", "join", "problem"),
    [
        ("", "", "CROWDTRAIN_ADMIN_TOKEN is not set"),
        ("   ", GOOD, "CROWDTRAIN_ADMIN_TOKEN is not set"),
        ("change-me-admin", "", "CROWDTRAIN_ADMIN_TOKEN is the published example value"),
        ("demo-admin", "", "CROWDTRAIN_ADMIN_TOKEN is the published example value"),
        (GOOD, "change-me-join", "CROWDTRAIN_JOIN_TOKEN is the published example value"),
        (GOOD, GOOD, "CROWDTRAIN_JOIN_TOKEN equals CROWDTRAIN_ADMIN_TOKEN"),
        ("x", "", "CROWDTRAIN_ADMIN_TOKEN is too easy to guess: about 0 bits of entropy, at least 128 needed"),
        ("operator-password-1", "", "CROWDTRAIN_ADMIN_TOKEN is too easy to guess"),
        ("a" * 64, "", "CROWDTRAIN_ADMIN_TOKEN is too easy to guess"),
        (GOOD, "j", "CROWDTRAIN_JOIN_TOKEN is too easy to guess"),
        (GOOD, "0123456789abcdef", "CROWDTRAIN_JOIN_TOKEN is too easy to guess: about 64 bits"),
    ],
)
def test_missing_or_published_tokens_are_named(admin: str, join: str, problem: str) -> None:
    settings = Settings(admin_token=admin, join_token=join)
    assert any(p.startswith(problem) for p in secrets_problems(settings)), secrets_problems(settings)
    with pytest.raises(InsecureSettings, match="secrets.token_urlsafe"):
        check_secrets(settings)


@pytest.mark.parametrize("join", ["", "another-" + GOOD])
def test_a_secret_admin_token_starts_with_or_without_a_bootstrap_join_token(join: str) -> None:
    assert secrets_problems(Settings(admin_token=GOOD, join_token=join)) == []


@pytest.mark.parametrize(
    "make", [lambda: secrets.token_urlsafe(16), lambda: secrets.token_hex(16), lambda: secrets.token_urlsafe(32)]
)
def test_random_tokens_of_128_bits_or_more_are_accepted(make) -> None:
    for _ in range(200):
        assert token_entropy_bits(make()) >= MIN_TOKEN_BITS


@pytest.mark.parametrize(
    ("token", "bits"),
    [
        ("7" * 40, 0),
        ("1234567890" * 3, 30 * math.log2(10)),
        ("0123456789abcdef" * 2, 128),
        ("Zx1r3FQ0d0kP2w9yq2m8sQ", 132),
    ],
)
def test_a_tokens_entropy_is_estimated_from_its_alphabet(token: str, bits: float) -> None:
    assert token_entropy_bits(token) == pytest.approx(bits)


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    assert Settings(trusted_proxies=" 10.0.0.5, 172.16.0.0/12 ,::1").trusted_proxies == "10.0.0.5,172.16.0.0/12,::1"
    with pytest.raises(ValueError, match="not an IP address or network: 'proxy.example.org'"):
        Settings(trusted_proxies="10.0.0.5,proxy.example.org")


def test_the_settings_ship_no_token() -> None:
    assert Settings.model_fields["admin_token"].default == "" and Settings.model_fields["join_token"].default == ""


def _without_tokens(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CROWDTRAIN_ADMIN_TOKEN", "CROWDTRAIN_JOIN_TOKEN")}
    return env | extra


@pytest.mark.parametrize(
    "env", [{}, {"CROWDTRAIN_ADMIN_TOKEN": "change-me-admin", "CROWDTRAIN_JOIN_TOKEN": "change-me-join"}]
)
def test_crowdtrain_server_refuses_to_start_and_says_how_to_set_a_token(tmp_path, env: dict) -> None:
    proc = subprocess.run(
        crowdtrain_argv("server", "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        env=_without_tokens(CROWDTRAIN_VAR_DIR=str(tmp_path), **env),
    )
    assert proc.returncode == 2, proc.stderr
    assert "CROWDTRAIN_ADMIN_TOKEN" in proc.stderr and "secrets.token_urlsafe(32)" in proc.stderr
    assert not (tmp_path / "crowdtrain.db").exists(), "nothing is done before the check"


def test_the_uvicorn_app_refuses_to_be_built_without_a_token(monkeypatch) -> None:
    import crowdtrain.server.api.app

    monkeypatch.delenv("CROWDTRAIN_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("CROWDTRAIN_JOIN_TOKEN", "change-me-join")
    get_settings.cache_clear()
    try:
        with pytest.raises(InsecureSettings, match="CROWDTRAIN_JOIN_TOKEN is the published example value"):
            _ = crowdtrain.server.api.app.app  # what `uvicorn crowdtrain.server.api.app:app` loads
    finally:
        get_settings.cache_clear()

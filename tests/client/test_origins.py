"""Which origins the client downloads from (client/origins.py)."""

import httpx
import pytest

from crowdtrain.client.origins import ForbiddenURL, Origins, check_url_text, learned_origins, parse_origin


@pytest.mark.parametrize(
    "text, origin",
    [
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("HTTPS://S3.Example.org/", "https://s3.example.org:443"),
        ("http://[::1]:8080", "http://[::1]:8080"),
    ],
)
def test_an_origin_is_normalized_with_its_port(text: str, origin: str) -> None:
    assert parse_origin(text) == origin


@pytest.mark.parametrize(
    "text",
    [
        "https://s3.example.org/bucket",
        "https://s3.example.org/?x=1",
        "https://user:pw@s3.example.org",
        "ftp://s3.example.org",
        "s3.example.org",
        "https://s3.example.org:99999",
        "https:// s3.example.org",
        "",
    ],
)
def test_anything_but_a_bare_http_origin_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_origin(text)


def test_only_the_scheduler_and_allowed_origins_are_fetched_from() -> None:
    origins = Origins.for_scheduler("http://sched.example.org/", ["https://s3.example.org"])
    for url in ["http://sched.example.org:80/v1/shards/1", "https://s3.example.org:443/b/k?X-Amz-Signature=1"]:
        origins.check(httpx.URL(url))
    for url in [
        "https://sched.example.org/v1/shards/1",
        "http://sched.example.org:8080/x",
        "http://169.254.169.254/latest/meta-data/",
        "http://s3.example.org/b/k",
        "http://sched.example.org@evil.example.org/x",
        "file:///etc/passwd",
    ]:
        with pytest.raises(ForbiddenURL):
            origins.check(httpx.URL(url))


@pytest.mark.parametrize("url", ["/v1/x\r\nHost: evil", "/v1/\\evil", "/v1/é", "/" + "a" * 5000])
def test_urls_with_odd_characters_or_of_unbounded_length_are_refused_before_parsing(url: str) -> None:
    with pytest.raises(ForbiddenURL):
        check_url_text(url)


def test_an_origin_announced_at_registration_is_learned_unless_no_object_store_could_be_there() -> None:
    announced = [
        "http://127.0.0.1:9000",
        "https://bucket.s3.amazonaws.com",
        "http://169.254.169.254",
        "http://0.0.0.0:9000",
        "http://[fe80::1]:9000",
        "http://metadata.google.internal",
        "not an origin",
    ]
    assert learned_origins(announced) == ["http://127.0.0.1:9000", "https://bucket.s3.amazonaws.com:443"]

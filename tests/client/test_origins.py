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
    assert learned_origins(announced, LOCAL_SCHEDULER) == [
        "http://127.0.0.1:9000",
        "https://bucket.s3.amazonaws.com:443",
    ]


LOCAL_SCHEDULER = "http://127.0.0.1:8000"
# The cloud metadata service in the spellings a resolver accepts, and its other addresses.
METADATA_SPELLINGS = [
    "http://2852039166",
    "http://0xa9fea9fe",
    "http://0xa9.0xfe.0xa9.0xfe",
    "http://169.254.43518",
    "http://169.254.169.254.",
    "http://[::ffff:169.254.169.254]",
    "http://[::ffff:a9fe:a9fe]",
    "http://[64:ff9b::a9fe:a9fe]",
    "http://[fd00:ec2::254]",
    "http://METADATA.google.internal.",
    "http://100.100.100.200",
]


@pytest.mark.parametrize(
    "text, origin",
    [
        ("http://2130706433:8000", "http://127.0.0.1:8000"),
        ("http://0x7f000001:8000", "http://127.0.0.1:8000"),
        ("http://127.1:8000", "http://127.0.0.1:8000"),
        ("http://[::ffff:127.0.0.1]:8000", "http://127.0.0.1:8000"),
        ("http://[0:0:0:0:0:0:0:1]:8000", "http://[::1]:8000"),
        ("http://S3.Example.org.:9000", "http://s3.example.org:9000"),
        ("http://2852039166", "http://169.254.169.254:80"),
    ],
)
def test_every_spelling_of_a_host_is_one_origin(text: str, origin: str) -> None:
    assert parse_origin(text) == origin


@pytest.mark.parametrize("url", METADATA_SPELLINGS)
def test_the_metadata_service_is_never_fetched_from_however_spelled_or_allowed(url: str) -> None:
    origins = Origins.for_scheduler(LOCAL_SCHEDULER, [url])  # even a volunteer's --allow-origin
    with pytest.raises(ForbiddenURL, match="metadata or link-local"):
        origins.check(httpx.URL(f"{url}/latest/meta-data/iam/security-credentials/"))
    assert learned_origins([url], LOCAL_SCHEDULER) == []


def test_a_loopback_spelled_differently_is_the_same_loopback() -> None:
    origins = Origins.for_scheduler(LOCAL_SCHEDULER)
    assert origins.check(httpx.URL("http://2130706433:8000/v1/files/1")) == LOCAL_SCHEDULER
    with pytest.raises(ForbiddenURL, match="refusing to download from http://127.0.0.1:9"):
        origins.check(httpx.URL("http://0x7f000001:9/"))


def test_a_remote_scheduler_cannot_point_the_client_at_the_volunteers_own_machine() -> None:
    announced = ["http://127.0.0.1:9000", "http://2130706433:6379", "http://[::1]:9000", "http://localhost:9000"]
    assert learned_origins(announced, "https://crowdtrain.example.org:443") == []
    assert learned_origins(announced, LOCAL_SCHEDULER) == [
        "http://127.0.0.1:9000",
        "http://127.0.0.1:6379",
        "http://[::1]:9000",
        "http://localhost:9000",
    ]


@pytest.mark.parametrize("url", ["http://1.2.3.4.5/", "http://99999999999/", "http://0x100000000/"])
def test_a_numeric_host_that_is_no_address_is_refused(url: str) -> None:
    with pytest.raises(ForbiddenURL):
        Origins.for_scheduler(LOCAL_SCHEDULER).check(httpx.URL(url))

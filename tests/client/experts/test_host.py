"""An expert host as a real process: its calls compute what the expert computes, and bad calls get a
4xx at once, never a hang, while the host goes on serving."""

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from crowdtrain.core.experts import ExpertLayout, encode_call, read_call
from crowdtrain.core.tensors import encode
from crowdtrain.core.zoo_experts import build_expert
from crowdtrain.launch.cluster import Service
from tests.client.experts.hosts import start_host

pytestmark = pytest.mark.integration

LAYOUT = ExpertLayout(layers=1, grid=[2, 2], dim=8, hidden=16, k=2, k_min=1, lr=0.01, max_rows=64)
SERVED = ["0.0.0", "0.1.1"]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    service, url = start_host(tmp_path_factory.mktemp("host"), "host", LAYOUT, SERVED)
    yield service, url
    service.stop()


def post(url: str, uid: str, kind: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/experts/{uid}/{kind}", content=body, timeout=30)


def test_forward_and_backward_compute_what_the_expert_computes_and_backward_takes_its_step(host) -> None:
    _, url = host
    rng = np.random.default_rng(1)
    x, g = rng.normal(size=(2, 5, LAYOUT.dim)).astype(np.float32)
    local = build_expert(LAYOUT, "0.1.1")
    optimizer = torch.optim.Adam(local.parameters(), lr=LAYOUT.lr)

    answer = post(url, "0.1.1", "forward", encode_call(x=x))
    assert answer.status_code == 200, answer.text
    y = read_call(answer.content, ("y",), LAYOUT.dim, LAYOUT.max_rows)["y"]
    np.testing.assert_allclose(y, local(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)

    answer = post(url, "0.1.1", "backward", encode_call(x=x, grad_y=g))
    assert answer.status_code == 200, answer.text
    grad_x = read_call(answer.content, ("grad_x",), LAYOUT.dim, LAYOUT.max_rows)["grad_x"]
    inputs = torch.from_numpy(x.copy()).requires_grad_(True)
    local(inputs).backward(torch.from_numpy(g))
    np.testing.assert_allclose(grad_x, inputs.grad.numpy(), rtol=1e-5, atol=1e-6)
    optimizer.step()

    stepped = read_call(post(url, "0.1.1", "forward", encode_call(x=x)).content, ("y",), LAYOUT.dim, 64)["y"]
    np.testing.assert_allclose(stepped, local(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(stepped, y)
    figures = httpx.get(f"{url}/v1/experts", timeout=10).json()
    assert figures["experts"]["0.1.1"]["steps"] == 1 and figures["experts"]["0.0.0"]["steps"] == 0
    assert figures["layout"]["grid"] == [2, 2]


ROWS = np.ones((3, LAYOUT.dim), np.float32)


@pytest.mark.parametrize(
    ("uid", "kind", "body", "status", "message"),
    [
        ("0.0.1", "forward", encode_call(x=ROWS), 404, "does not serve expert"),
        ("9.9", "forward", encode_call(x=ROWS), 404, "does not serve"),
        ("0.0.0", "sideways", encode_call(x=ROWS), 404, "forward or backward"),
        ("0.0.0", "forward", b"not tensors at all", 400, "not a safetensors file"),
        ("0.0.0", "forward", encode({"x": np.ones((3, 5), np.float32)}), 422, "expected [rows, 8]"),
        ("0.0.0", "forward", encode({"x": np.full((3, 8), np.nan, np.float32)}), 422, "NaN"),
        ("0.0.0", "backward", encode_call(x=ROWS), 422, "carries tensors"),
        ("0.0.0", "forward", encode_call(x=np.ones((65, 8), np.float32)), 422, "1 to 64 rows"),
        ("0.0.0", "forward", encode_call(x=np.ones((200, 8), np.float32)), 413, "at most"),
    ],
)
def test_a_bad_call_gets_a_4xx_that_says_why_and_the_host_goes_on(host, uid, kind, body, status, message) -> None:
    _, url = host
    started = time.monotonic()
    answer = post(url, uid, kind, body)
    assert answer.status_code == status and message in answer.json()["detail"], answer.text
    assert time.monotonic() - started < 10
    assert post(url, "0.0.0", "forward", encode_call(x=ROWS)).status_code == 200


def test_a_body_declared_too_large_is_refused_before_it_is_sent(host) -> None:
    _, url = host
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/experts/0.0.0/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")


def test_a_caller_that_stalls_mid_body_holds_up_no_one_else(host) -> None:
    _, url = host
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/experts/0.0.0/forward HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b"\x00" * 10)
        answer = post(url, "0.0.0", "forward", encode_call(x=ROWS))
        assert answer.status_code == 200


def test_a_host_refuses_to_start_with_an_expert_outside_the_layout(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not in the layout"):
        start_host(tmp_path, "bad", LAYOUT, ["0.5.5"])

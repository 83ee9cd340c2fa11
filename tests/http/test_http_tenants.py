"""Tenants over HTTP: `x-request-id`s are scoped by tenant (two tenants may use one at once; one
tenant's id in flight is still 409), and --auth-metrics puts /metrics behind a Control token
while /health and /version stay open for probes."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serving_http import ServerThread, http_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tenants(model_dir, core: tuple[str, ...]) -> Iterator[ServerThread]:
    """Tenants `alpha` and `beta`, the Control token `ops` and --auth-metrics; scripted
    tokens, slowed so long requests still run when a test acts on them."""
    flags = ("--auth-token", "alpha", "--auth-token", "beta", "--control-auth-token", "ops")
    flags += ("--auth-metrics", *core)
    with http_server(model_dir("llama"), *flags, fake_runner=True, step_delay_s=0.005) as served:
        yield served


def status_of(url: str, token: str | None = None) -> int:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10):
            return 200
    except urllib.error.HTTPError as error:
        return error.code


def test_two_tenants_use_one_request_id_at_once(tenants: ServerThread) -> None:
    served = tenants
    same = {"x-request-id": "job-7"}

    async def main() -> list[Any]:
        async with (
            served.async_client(api_key="alpha") as alpha,
            served.async_client(api_key="beta") as beta,
        ):
            first = await alpha.completions.create(
                model=served.model, prompt="Hi", max_tokens=1500, stream=True, extra_headers=same
            )
            await first.__anext__()  # admitted: alpha's job-7 is in flight
            try:
                other = await beta.completions.with_raw_response.create(
                    model=served.model, prompt="Hi", max_tokens=2, extra_headers=same
                )
                try:
                    await alpha.completions.create(
                        model=served.model, prompt="Hi", max_tokens=2, extra_headers=same
                    )
                except openai.APIStatusError as exc:
                    return [other, exc.status_code, exc.body]
            finally:
                await first.close()
        raise AssertionError("alpha's id in flight was taken twice")

    other, status, body = asyncio.run(main())
    assert other.headers["x-request-id"] == "job-7"
    assert other.parse().id == "cmpl-job-7" and other.parse().usage.completion_tokens == 2
    assert status == 409 and body["code"] == "duplicate_request_id"
    assert body["param"] == "x-request-id" and "@" not in body["message"]
    served.assert_nothing_left()


def test_auth_metrics_takes_the_control_token_and_leaves_probes_open(
    tenants: ServerThread,
) -> None:
    url = tenants.base_url
    assert status_of(url + "/metrics") == 401
    assert status_of(url + "/metrics", "alpha") == 401  # a tenant sees no server-wide figures
    assert status_of(url + "/metrics", "ops") == 200
    for path in ("/health", "/version"):
        assert status_of(url + path) == 200


@pytest.mark.parametrize(
    "path", ["/get_load", "/get_loads", "/v1/loads", "/loads", "/get_server_info",
             "/server_info", "/get_model_info", "/model_info"],
)  # fmt: skip
def test_the_routers_routes_take_the_control_token_as_controls_rpcs_do(
    tenants: ServerThread, path: str
) -> None:
    """Every tenant's load, the server's settings and the model's path: as Control's
    GetLoads / GetServerInfo / GetModelInfo over gRPC. They answered anyone, token or not."""
    url = tenants.base_url + path
    assert status_of(url) == 401
    assert status_of(url, "alpha") == 401
    assert status_of(url, "ops") == 200

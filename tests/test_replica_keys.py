"""`kvserve serve --replicas`: every replica gets the admin key and the request limits of one
server, and the ingress guards its own operator routes (/v1/replicas, the merged /metrics) with the
replicas' rules. No Ray here: the flags as parsed, and the ingress over a stand-in handle."""

import asyncio

import pytest
from starlette.requests import Request

from kvserve.cli import build_parser
from kvserve.server.replicas import Ingress, replica_app_kwargs

ADMIN, TENANT = "sk-admin-0123456789", "sk-tenant-0123456789"


def test_each_replica_gets_the_admin_key_and_the_limits():
    args = build_parser().parse_args(["serve", "--replicas", "2", "--api-key", TENANT, "--admin-api-key", ADMIN,
                                      "--max-request-tokens", "5000", "--max-running-per-key", "3",
                                      "--max-concurrent-requests", "40"])
    kwargs = replica_app_kwargs(args, [TENANT], ADMIN)
    assert kwargs["api_key"] == [TENANT] and kwargs["admin_api_key"] == ADMIN
    assert (kwargs["max_request_tokens"], kwargs["max_running_per_key"], kwargs["max_concurrent_requests"]) == (5000, 3, 40)
    import inspect

    from kvserve.server.app import build_app
    assert set(kwargs) - {"metrics_names"} <= set(inspect.signature(build_app).parameters)   # build_app takes them all


class Handle:
    """Stands in for the engine deployment's handle: the ingress only asks it for options."""

    app_name = "kvserve"

    def options(self, **_):
        return self


def request(path: str, key: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": headers})


@pytest.mark.parametrize("path", ["/v1/replicas", "/metrics"])
@pytest.mark.parametrize("key,status", [(None, 401), ("sk-wrong", 401), (TENANT, 403)])
def test_the_ingress_operator_routes_need_the_admin_key(path, key, status):
    ingress = Ingress(Handle(), None, api_keys=[TENANT], admin_api_key=ADMIN)
    answer = asyncio.run(ingress(request(path, key)))
    assert answer.status_code == status
    ingress._check_operator(request(path, ADMIN))   # the admin key passes


def test_without_an_admin_key_isolated_tenants_cannot_read_the_replicas():
    ingress = Ingress(Handle(), None, cache_isolation="api-key", api_keys=[TENANT])
    assert asyncio.run(ingress(request("/v1/replicas", TENANT))).status_code == 403

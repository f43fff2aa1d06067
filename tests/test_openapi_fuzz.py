"""A fuzz run of mola's own OpenAPI document with schemathesis against a real
server on 127.0.0.1: whatever the generated request, no 5xx and no hang.
Bounded: a few dozen examples per operation, short contexts."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from mola.config import AdapterSpec

from helpers.servers import start_server

pytestmark = pytest.mark.slow  # long end-to-end: CI's second tier (pytest -m slow)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, adapters):
    # A short context keeps every generated request's generation short.
    handle = start_server(model=str(tiny_model), served_model_name="tiny", max_model_len=48,
                          adapters=(AdapterSpec("a", str(adapters["a"])),), max_loras=2,
                          max_lora_rank=16, request_timeout=20)
    yield handle
    handle.stop()


def test_no_server_errors_and_no_hangs(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10  # every route of mola's own document is fuzzed

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(timeout=30)
            where = (case.method, case.path, case.path_parameters, case.body)
            assert response.status_code < 500, (where, response.text[:500])
            if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                error = response.json().get("error", {})
                assert isinstance(error.get("message"), str) and error["message"], response.text

        fuzz()
    assert fuzz_server.engine.is_alive

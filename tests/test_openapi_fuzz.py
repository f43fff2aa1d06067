"""A fuzz run of mola's own OpenAPI document with schemathesis against the app
in process over a scripted engine (validation and errors are the subject, no
model runs): whatever the generated request, no 5xx and no hang. Bounded: a
few dozen examples per operation, short contexts."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from requests.structures import CaseInsensitiveDict

from mola.config import AdapterSpec

from helpers.scripted import InProcessServer, tokenizer_model

pytestmark = pytest.mark.slow  # long end-to-end: CI's second tier (pytest -m slow)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, adapters):
    # A short context keeps every generated request's generation short.
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", max_model_len=48,
                             adapters=(AdapterSpec("a", str(adapters["a"])),), max_loras=2,
                             max_lora_rank=16, request_timeout=20)
    yield handle
    handle.stop()


class InProcess(requests.adapters.BaseAdapter):
    """A requests transport (schemathesis speaks requests) onto the app's httpx client."""

    def __init__(self, client):
        super().__init__()
        self.client = client

    def send(self, request, **kwargs):
        body = request.body.encode() if isinstance(request.body, str) else request.body
        r = self.client.request(request.method, request.url, headers=dict(request.headers), content=body)
        response = requests.Response()
        response.status_code, response._content, response.url = r.status_code, r.content, request.url
        response.headers, response.request, response.encoding = CaseInsensitiveDict(r.headers), request, r.encoding
        return response

    def close(self):
        pass


def test_no_server_errors_and_no_hangs(fuzz_server):
    with fuzz_server.client(timeout=30) as c, requests.Session() as session:
        session.mount("http://mola", InProcess(c))
        schema = schemathesis.openapi.from_dict(c.get("/openapi.json").json())
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 10  # every route of mola's own document is fuzzed

        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                response = case.call(base_url="http://mola", session=session)
                where = (case.method, case.path, case.path_parameters, case.body)
                assert response.status_code < 500, (where, response.text[:500])
                if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                    error = response.json().get("error", {})
                    assert isinstance(error.get("message"), str) and error["message"], response.text

            fuzz()
        assert c.get("/health").status_code == 200  # and the app still serves

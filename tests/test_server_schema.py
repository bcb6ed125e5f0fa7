"""schemathesis over our own OpenAPI schema: whatever it sends, the server never answers 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

# Part of the full run only: `python -m pytest -m "not slow"` is the quick subset.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server[0]}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    # Generated requests may ask for many tokens: keep each answer short but real.
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens", "num_predict"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"

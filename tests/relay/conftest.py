from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.relay.brokers import BROKERS, OPENERS, Broker


@pytest_asyncio.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async with OPENERS[request.param]() as opened:
        yield opened

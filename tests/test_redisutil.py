"""The Redis the cluster tests run: started, stopped and started again on the same port, through redis.asyncio."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.redisutil import RedisServer

pytestmark = pytest.mark.integration


async def test_redis_comes_back_empty_on_the_same_port_after_stop_and_kill(redis_server: RedisServer) -> None:
    # No retries: redis-py's default ten, with backoff, would wait out the outage below.
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                     retry=Retry(NoBackoff(), 0))
    try:
        assert await client.ping()
        await client.set("k", "v")
        port = redis_server.port
        assert await redis_server.stop() == 0
        assert not redis_server.running
        with pytest.raises(RedisConnectionError):
            await client.ping()
        await redis_server.start()
        # The same URL again; nothing persisted, so the old key is gone.
        assert (redis_server.port, await client.ping(), await client.get("k")) == (port, True, None)
        assert await redis_server.kill() == -9
        assert not await redis_server.ping()
        await redis_server.start()
        assert await redis_server.ping()
    finally:
        await client.aclose()

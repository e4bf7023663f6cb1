"""The key store's backends against one contract (a real SQLite file, a real redis-server), and the KeyRing's lookup
and polling on top of a real store."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from gateway.config import ApiKeyConfig, AuthConfig, StoreConfig
from gateway.keystore.keyring import ANONYMOUS, Identity, KeyRing
from gateway.keystore.records import KeyRecord, digest_of, new_key_id, new_secret
from gateway.keystore.redis_store import RedisKeyStore
from gateway.keystore.sqlite_store import SqliteKeyStore
from gateway.keystore.store import KeyStoreBackend
from gateway.observability.telemetry import Metrics
from tests.conftest import Partition, RedisServer

OpenStore = Callable[[], KeyStoreBackend]


def stored_key(tenant: str = "team-a", **settings) -> tuple[str, KeyRecord]:
    """A new secret and the record the admin API would store for it."""
    key_id = new_key_id()
    secret = new_secret(key_id)
    now = settings.pop("created_at", time.time())
    record = KeyRecord(id=key_id, tenant=tenant, digest=digest_of(secret), created_at=now, updated_at=now, **settings)
    return secret, record


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def opened(ring: KeyRing, secret: str) -> str | None:
    """The id of the key a secret opens (None: it opens nothing)."""
    identity = ring.lookup(bearer(secret))
    return identity.key_id if identity else None


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens another backend object on the same store (one file, one redis-server) each time it is called."""
    if request.param == "sqlite":
        yield lambda: SqliteKeyStore(tmp_path / "keys.db")
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        yield lambda: RedisKeyStore(server.url, timeout=2.0)


def run(open_store: OpenStore, scenario: Callable[..., Awaitable[None]], stores: int = 1) -> None:
    async def main() -> None:
        opened = [open_store() for _ in range(stores)]
        try:
            await scenario(*opened)
        finally:
            for store in opened:
                await store.aclose()

    asyncio.run(main())


def test_put_get_and_records_oldest_first(open_store: OpenStore) -> None:
    _, older = stored_key("team-a", created_at=1000.0)
    _, newer = stored_key("team-b", created_at=2000.0)
    _, oldest = stored_key("team-a", created_at=500.0, label="first")

    async def scenario(store: KeyStoreBackend) -> None:
        assert await store.get(older.id) is None
        for record in (older, newer, oldest):
            await store.put(record)
        assert await store.get(newer.id) == newer
        assert [r.id for r in await store.records()] == [oldest.id, older.id, newer.id]
        assert await store.records("team-a") == [oldest, older]
        assert await store.records("team-c") == []
        revoked = older.model_copy(update={"revoked_at": 3000.0, "label": "gone"})
        await store.put(revoked)  # replaces: revoked records stay, for the audit log
        assert await store.get(older.id) == revoked
        assert len(await store.records()) == 3

    run(open_store, scenario)


def test_changes_since_a_version(open_store: OpenStore) -> None:
    _, first = stored_key()
    _, second = stored_key()

    async def scenario(store: KeyStoreBackend) -> None:
        assert (await store.changes(0))[1:] == (0, [])
        await store.put(first)
        epoch, v1, changed = await store.changes(0)
        assert v1 > 0 and changed == [first]
        await store.put(second)
        assert (await store.changes(v1))[1:] == (v1 + 1, [second])
        assert await store.changes(v1 + 1) == (epoch, v1 + 1, [])  # one lifetime of the store: one epoch
        revoked = first.model_copy(update={"revoked_at": time.time()})
        await store.put(revoked)
        assert (await store.changes(v1 + 1))[1:] == (v1 + 2, [revoked])
        assert (await store.changes(0)).records == [second, revoked]  # in the order of their last change

    run(open_store, scenario)


def test_concurrent_puts_from_two_store_objects_each_get_their_own_version(open_store: OpenStore) -> None:
    records = [stored_key(f"team-{i % 3}")[1] for i in range(40)]

    async def scenario(one: KeyStoreBackend, two: KeyStoreBackend) -> None:
        await asyncio.gather(*(store.put(r) for r, store in zip(records, [one, two] * 20)))
        _, version, changed = await two.changes(0)
        assert version == len(records)
        assert sorted(r.id for r in changed) == sorted(r.id for r in records)
        # every put bumped the version once: after version k, exactly the puts numbered above k remain
        for since in range(0, version, 7):
            assert len((await one.changes(since)).records) == version - since

    run(open_store, scenario, stores=2)


def test_sqlite_store_keeps_its_records_across_objects(tmp_path: Path) -> None:
    _, record = stored_key()

    async def scenario() -> None:
        store = SqliteKeyStore(tmp_path / "keys.db")
        await store.put(record)
        epoch = (await store.changes(0)).epoch
        await store.aclose()
        reopened, another = SqliteKeyStore(tmp_path / "keys.db"), SqliteKeyStore(tmp_path / "another.db")
        assert await reopened.changes(0) == (epoch, 1, [record])
        assert (await another.changes(0)).epoch != epoch  # a file made anew counts its versions again
        await reopened.aclose()
        await another.aclose()

    asyncio.run(scenario())


STATIC_SECRET = "sk-static-team"


def static_keys() -> AuthConfig:
    return AuthConfig(
        keys=[ApiKeyConfig(tenant="static-team", sha256=hashlib.sha256(STATIC_SECRET.encode()).hexdigest())]
    )


def new_ring(store: KeyStoreBackend, auth: AuthConfig | None = None, **settings: float) -> KeyRing:
    """A ring over `store`, with these `store` settings (`poll_interval`, `max_key_staleness`)."""
    return KeyRing(auth or AuthConfig(), store, StoreConfig(**settings), Metrics().key_store_synced)


def ring_on(records: list[KeyRecord], path: Path, auth: AuthConfig | None = None) -> KeyRing:
    """A ring loaded from a real SQLite store (at `path`) holding these records."""

    async def load() -> KeyRing:
        store = SqliteKeyStore(path)
        for record in records:
            await store.put(record)
        ring = new_ring(store, auth)
        await ring.refresh()
        await store.aclose()
        return ring

    return asyncio.run(load())


def test_ring_opens_a_stored_key_with_its_current_secret(tmp_path: Path) -> None:
    secret, record = stored_key("team-a", label="ci")
    ring = ring_on([record], tmp_path / "ring.db")
    identity = ring.identify(bearer(secret))
    assert isinstance(identity, Identity)
    assert (identity.tenant, identity.label, identity.key_id, identity.record) == ("team-a", "ci", record.id, record)
    assert ring.lookup({"x-api-key": secret}) == identity
    assert ring.identify(bearer(new_secret(record.id))) == "invalid_api_key"  # its id, another secret
    assert ring.identify(bearer(new_secret(new_key_id()))) == "invalid_api_key"
    assert ring.identify({}) == "missing_api_key"
    assert ring.lookup(bearer("sk-nothing")) is None


def rotated_key(grace_left: float) -> tuple[str, str, KeyRecord]:
    """A key's secret before and after a rotation, and its record with `grace_left` seconds of grace for the old."""
    old_secret, record = stored_key()
    secret = new_secret(record.id)
    update = {
        "digest": digest_of(secret),
        "previous_digest": digest_of(old_secret),
        "previous_valid_until": time.time() + grace_left,
    }
    return old_secret, secret, record.model_copy(update=update)


def test_ring_accepts_a_rotated_out_secret_only_within_its_grace(tmp_path: Path) -> None:
    old_in_grace, new_in_grace, in_grace = rotated_key(60)
    old_past_grace, new_past_grace, past_grace = rotated_key(-1)
    ring = ring_on([in_grace, past_grace], tmp_path / "ring.db")
    assert opened(ring, old_in_grace) == in_grace.id
    assert opened(ring, new_in_grace) == in_grace.id
    assert ring.identify(bearer(old_past_grace)) == "invalid_api_key"
    assert opened(ring, new_past_grace) == past_grace.id


def test_ring_refuses_expired_and_revoked_keys(tmp_path: Path) -> None:
    expired_secret, expired = stored_key(expires_at=time.time() - 1)
    revoked_secret, revoked = stored_key(revoked_at=time.time() - 1)
    expired_and_revoked_secret, expired_and_revoked = stored_key(expires_at=time.time() - 1, revoked_at=time.time())
    live_secret, live = stored_key(expires_at=time.time() + 60)
    ring = ring_on([expired, revoked, expired_and_revoked, live], tmp_path / "ring.db")
    assert ring.identify(bearer(expired_secret)) == "expired_api_key"
    assert ring.lookup(bearer(expired_secret)) is None
    assert ring.identify(bearer(revoked_secret)) == "invalid_api_key"  # as an unknown key: never says revoked
    assert ring.identify(bearer(expired_and_revoked_secret)) == "invalid_api_key"
    assert ring.identify(bearer(new_secret(expired.id))) == "invalid_api_key"  # only its holder learns it expired
    assert opened(ring, live_secret) == live.id


def test_ring_keeps_static_keys_beside_stored_ones(tmp_path: Path) -> None:
    secret, record = stored_key("team-a")
    ring = ring_on([record], tmp_path / "ring.db", static_keys())
    static = ring.lookup(bearer(STATIC_SECRET))
    assert static is not None and static.tenant == "static-team" and static.record is None
    assert static.key_id == hashlib.sha256(STATIC_SECRET.encode()).hexdigest()[:12]
    assert opened(ring, secret) == record.id
    assert ring.identify(bearer(STATIC_SECRET + "x")) == "invalid_api_key"


def test_ring_is_anonymous_only_while_no_key_ever_existed(tmp_path: Path) -> None:
    anonymous = Identity(ANONYMOUS, "", "")
    assert ring_on([], tmp_path / "none.db").identify({}) == anonymous
    assert ring_on([], tmp_path / "off.db", AuthConfig(anonymous=False)).identify({}) == "missing_api_key"
    revoked_only = ring_on([stored_key(revoked_at=1.0)[1]], tmp_path / "revoked.db")
    assert revoked_only.identify({}) == "missing_api_key"  # revoking the last key does not open the gateway
    assert revoked_only.identify(bearer("sk-any")) == "invalid_api_key"
    expired_only = ring_on([stored_key(expires_at=1.0)[1]], tmp_path / "expired.db")
    assert expired_only.identify({}) == "missing_api_key"  # an expired key keeps the gateway closed
    assert ring_on([], tmp_path / "static.db", static_keys()).identify({}) == "missing_api_key"


def test_a_ring_that_saw_a_key_stays_closed_when_its_store_loses_it(redis_server: RedisServer) -> None:
    secret, record = stored_key()

    async def run() -> None:
        store = RedisKeyStore(redis_server.url, timeout=2.0)
        ring = new_ring(store)
        try:
            await ring.refresh()
            assert ring.identify({}) == Identity(ANONYMOUS, "", ""), "no key yet: a first run is open"
            await store.put(record)
            await ring.refresh()
            assert opened(ring, secret) == record.id
            redis_server.client().flushall()  # a Redis without persistence restarted: its keys are gone
            await ring.refresh()
            assert ring.identify({}) == "missing_api_key"
            assert ring.identify(bearer(secret)) == "invalid_api_key"
        finally:
            await store.aclose()

    asyncio.run(run())


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `condition` holds (the ring polls meanwhile)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "the ring did not catch up"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def test_ring_polls_changes_and_keeps_its_keys_through_a_store_outage(redis_server: RedisServer) -> None:
    secret, record = stored_key()
    later_secret, later = stored_key()

    async def scenario() -> None:
        writer = RedisKeyStore(redis_server.url, timeout=2.0)
        ring = new_ring(RedisKeyStore(redis_server.url, timeout=2.0), static_keys(), poll_interval=0.05)
        await ring.start()
        await writer.put(record)
        await until(lambda: opened(ring, secret) == record.id)
        await writer.put(record.model_copy(update={"revoked_at": time.time()}))
        assert await until(lambda: opened(ring, secret) is None) < 1.0
        await writer.put(record)
        await until(lambda: opened(ring, secret) == record.id)
        await writer.aclose()

        redis_server.kill()
        await asyncio.sleep(0.3)  # several failed polls
        assert opened(ring, secret) == record.id  # still the keys it had

        redis_server.start()  # empty: its version starts again, below the ring's
        writer = RedisKeyStore(redis_server.url, timeout=2.0)
        await writer.put(later)
        await until(lambda: opened(ring, later_secret) == later.id)
        assert opened(ring, secret) is None  # reloaded whole: the keys the store lost are gone
        await writer.aclose()
        await ring.aclose()

    asyncio.run(scenario())


async def refreshed(ring: KeyRing, timeout: float = 5.0) -> None:
    """Refresh the ring once the store answers again (its pooled connections died with the old server)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await ring.refresh()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("restart", ["empty", "snapshot", "flushall"])
def test_a_ring_reloads_whole_when_redis_restarts_and_its_version_climbs_past_the_rings(
    redis_server: RedisServer, restart: str
) -> None:
    """Redis restarted empty, from a snapshot older than the ring's copy, or wiped; then enough changes to bring its
    version above the ring's before the ring polls: the ring must still see every change made since, the revocation
    of a key it holds among them, and drop the keys the store lost."""
    kept_secret, kept = stored_key()
    lost_secret, lost = stored_key()
    fresh = [stored_key() for _ in range(3)]

    async def scenario() -> None:
        writer, polled = RedisKeyStore(redis_server.url, timeout=2.0), RedisKeyStore(redis_server.url, timeout=2.0)
        ring = new_ring(polled, static_keys())
        await writer.put(kept)
        redis_server.client().save()  # the snapshot a restart "from a snapshot" loads: `kept` only
        await writer.put(lost)
        await ring.refresh()
        assert opened(ring, kept_secret) == kept.id and opened(ring, lost_secret) == lost.id
        if restart == "flushall":
            redis_server.client().flushall()
        else:
            if restart == "empty":
                (redis_server.directory / "dump.rdb").unlink()
            redis_server.kill()
            redis_server.start()
            await writer.aclose()
            writer = RedisKeyStore(redis_server.url, timeout=2.0)
        await writer.put(kept.model_copy(update={"revoked_at": time.time()}))
        for _, record in fresh:
            await writer.put(record)
        await refreshed(ring)
        assert opened(ring, kept_secret) is None, "revoked after the restart"
        assert [opened(ring, secret) for secret, _ in fresh] == [record.id for _, record in fresh]
        assert opened(ring, lost_secret) is None, "the store lost it"
        await writer.aclose()
        await polled.aclose()

    asyncio.run(scenario())


def test_a_ring_cut_off_from_redis_serves_its_copy_for_max_key_staleness_then_refuses_stored_keys_until_it_answers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A key revoked through an instance that reaches Redis, while this one cannot: this one accepts it from its copy
    for `store.max_key_staleness` at most, then refuses every stored key as `key_store_unavailable` (static keys
    need no store); once Redis answers again the revocation applies within a poll. The staleness shows in the
    synced-at gauge and the log."""
    secret, record = stored_key()
    max_staleness, poll = 2.0, 0.05
    partition = Partition(redis_server.port)
    metrics = Metrics()

    def synced() -> float:
        value = metrics.registry.get_sample_value("portcullis_key_store_synced_timestamp_seconds")
        assert value is not None
        return value

    async def scenario() -> None:
        writer = RedisKeyStore(redis_server.url, timeout=2.0)
        polled = RedisKeyStore(f"redis://127.0.0.1:{partition.port}/0", timeout=0.25)
        ring = KeyRing(
            static_keys(),
            polled,
            StoreConfig(poll_interval=poll, max_key_staleness=max_staleness),
            metrics.key_store_synced,
        )
        # a first run's ring, open while no key exists: past the bound it cannot know that none was made since
        keyless = RedisKeyStore(f"redis://127.0.0.1:{partition.port}/1", timeout=0.25)
        anonymous = new_ring(keyless, poll_interval=poll, max_key_staleness=max_staleness)
        await writer.put(record)
        await ring.start()
        await anonymous.start()
        assert opened(ring, secret) == record.id and anonymous.anonymous
        partition.cut()
        cut_at = time.monotonic()
        await writer.put(record.model_copy(update={"revoked_at": time.time()}))
        assert opened(ring, secret) == record.id, "within the bound, the copy serves (fail open)"
        await until(lambda: ring.identify(bearer(secret)) == "key_store_unavailable", timeout=max_staleness + 3)
        assert time.monotonic() - cut_at >= max_staleness - poll  # its last read may have been a poll before
        assert time.time() - synced() > max_staleness
        assert ring.identify(bearer(new_secret(new_key_id()))) == "key_store_unavailable"  # unknown: cannot tell
        assert opened(ring, STATIC_SECRET) is not None and ring.identify({}) == "missing_api_key"
        await until(lambda: anonymous.identify({}) == "key_store_unavailable")
        assert "stored keys are refused with 503 key_store_unavailable" in caplog.text

        partition.heal()
        # within a poll; the slack is a loaded machine's (before the bound, it took as long as the partition)
        assert await until(lambda: ring.identify(bearer(secret)) == "invalid_api_key") < poll + 1.5
        assert synced() > time.time() - 2
        assert "stored keys are accepted again" in caplog.text
        await until(lambda: anonymous.identify({}) == Identity(ANONYMOUS, "", ""))
        for closing in (ring, anonymous, writer, polled, keyless):
            await closing.aclose()

    try:
        asyncio.run(scenario())
    finally:
        partition.cut()

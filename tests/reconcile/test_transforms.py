"""Every check on small literal DataFrames, against literal expected rows."""

from __future__ import annotations

import json
import zlib
from datetime import UTC, datetime

import pytest

from service.reconcile import transforms as T
from service.reconcile.transforms import Window

pytestmark = pytest.mark.spark

WINDOW = Window(datetime(2024, 5, 1, tzinfo=UTC), datetime(2024, 5, 2, tzinfo=UTC))
CUTOFF = datetime(2024, 5, 1, 20, 0, tzinfo=UTC)  # "now - stuck_after"


def ts(day: int, hour: int, minute: int = 0, second: int = 0) -> datetime:
    return datetime(2024, 5, day, hour, minute, second, tzinfo=UTC)


def mod(
    rid, status="COMPLETED", received=None, sha="s", rtype="invoice.created", owner="w1", id_=None
):
    received = received or ts(1, 10)
    completed = None if status == "IN_PROGRESS" else received
    return (id_ or zlib.crc32(rid.encode()), rid, rtype, status, sha, owner, received, completed)


def mods_df(spark, rows):
    return spark.createDataFrame(rows, T.MODIFICATIONS_SCHEMA)


def kinds(df):
    return df.select("kind", "request_id", "entity_id", "source")


def test_stuck_in_progress(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    mods = mods_df(
        spark,
        [
            mod("old-claim", "IN_PROGRESS", ts(1, 10), rtype="entity.upsert"),
            mod("done", "COMPLETED", ts(1, 10)),
            mod("before-window", "IN_PROGRESS", ts(1, 0) - (ts(1, 1) - ts(1, 0))),
            mod("at-window-end", "IN_PROGRESS", ts(2, 0)),
            mod("young-claim", "IN_PROGRESS", ts(1, 23)),  # after the cutoff: in flight
            mod("at-cutoff", "IN_PROGRESS", CUTOFF),
        ],
    )
    got = T.stuck_in_progress(mods, window=WINDOW, inflight_cutoff=CUTOFF, source="primary")
    assertDataFrameEqual(
        got,
        spark.createDataFrame(
            [
                (
                    "stuck_in_progress",
                    "old-claim",
                    None,
                    "primary",
                    '{"request_type":"entity.upsert","owner":"w1",'
                    '"received_at":"2024-05-01T10:00:00.000Z"}',
                )
            ],
            T.DISCREPANCY_SCHEMA,
        ),
    )


def test_compare_databases_reports_each_kind_once(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    primary = mods_df(
        spark,
        [
            mod("same"),
            mod("only-primary"),
            mod("status", "COMPLETED"),
            mod("status-young", "COMPLETED", ts(1, 21)),
            mod("payload", sha="aaa"),
            mod("both-wrong", "COMPLETED", sha="aaa"),
            mod("midnight", received=ts(1, 23, 59, 59)),
            mod("margin-only", received=ts(1, 0) - (ts(1, 1) - ts(1, 0))),
            mod("only-primary-young", received=ts(1, 21)),
        ],
    )
    peer = mods_df(
        spark,
        [
            mod("same"),
            mod("only-peer"),
            mod("status", "IN_PROGRESS"),
            mod("status-young", "IN_PROGRESS", ts(1, 21)),
            mod("payload", sha="bbb"),
            mod("both-wrong", "IN_PROGRESS", sha="bbb"),
            mod("midnight", received=ts(2, 0, 0, 1)),  # the peer crossed midnight: not missing
        ],
    )
    got = T.compare_databases(
        primary, peer, window=WINDOW, inflight_cutoff=CUTOFF, peer_label="peer1"
    )
    assertDataFrameEqual(
        kinds(got),
        [
            ("missing_in_peer", "only-primary", None, "peer1"),
            ("missing_in_primary", "only-peer", None, "peer1"),
            ("status_mismatch", "status", None, "peer1"),
            ("status_mismatch", "both-wrong", None, "peer1"),
            ("payload_mismatch", "payload", None, "peer1"),
            ("payload_mismatch", "both-wrong", None, "peer1"),
        ],
    )
    details = {(r["kind"], r["request_id"]): json.loads(r["details"]) for r in got.collect()}
    assert details[("payload_mismatch", "payload")] == {
        "primary_sha256": "aaa",
        "peer_sha256": "bbb",
    }
    assert details[("missing_in_peer", "only-primary")] == {
        "present_in": "primary",
        "missing_in": "peer1",
        "primary": {
            "status": "COMPLETED",
            "request_type": "invoice.created",
            "received_at": "2024-05-01T10:00:00.000Z",
        },
    }
    assert details[("missing_in_primary", "only-peer")]["missing_in"] == "primary"
    assert details[("status_mismatch", "status")] == {
        "primary": {
            "status": "COMPLETED",
            "request_type": "invoice.created",
            "received_at": "2024-05-01T10:00:00.000Z",
        },
        "peer": {
            "status": "IN_PROGRESS",
            "request_type": "invoice.created",
            "received_at": "2024-05-01T10:00:00.000Z",
        },
    }


def test_compare_identical_databases_is_clean(spark) -> None:
    rows = [mod("a"), mod("b", "IN_PROGRESS"), mod("c", sha="x")]
    got = T.compare_databases(
        mods_df(spark, rows),
        mods_df(spark, rows),
        window=WINDOW,
        inflight_cutoff=CUTOFF,
        peer_label="peer1",
    )
    assert got.count() == 0


def test_differing_buckets(spark) -> None:
    primary = [(1, 10, "100"), (2, 10, "200"), (3, 10, "300"), (4, 1, "7")]
    peer = [(1, 10, "100"), (2, 9, "200"), (3, 10, "301"), (5, 1, "7")]
    got = T.differing_buckets(
        spark.createDataFrame(primary, T.DIGESTS_SCHEMA),
        spark.createDataFrame(peer, T.DIGESTS_SCHEMA),
    )
    # 1 alike; 2 a count apart, 3 a digest apart; 4 and 5 on one side only.
    assert sorted(r["bucket"] for r in got.collect()) == [2, 3, 4, 5]


def emod(id_, rid, rtype, entity, version, md5, completed, applied=None):
    return (id_, rid, rtype, entity, version, md5, completed, applied)


ENTITY_MODS = [
    # e1: versions arrive out of order; v3 wins although v2 completed last.
    emod(1, "e1-v1", "entity.upsert", "e1", 1, "d1", ts(1, 1)),
    emod(3, "e1-v3", "entity.upsert", "e1", 3, "d3", ts(1, 2)),
    emod(2, "e1-v2", "entity.upsert", "e1", 2, "d2", ts(1, 3)),
    # e2: deleted after an upsert.
    emod(4, "e2-v1", "entity.upsert", "e2", 1, "x1", ts(1, 1)),
    emod(5, "e2-del", "entity.delete", "e2", 2, None, ts(1, 2)),
    # e3: a version tie; the first to complete landed, the second was stale.
    emod(7, "e3-late", "entity.upsert", "e3", 5, "late", ts(1, 5)),
    emod(6, "e3-first", "entity.upsert", "e3", 5, "first", ts(1, 4)),
    # e4: a delete of an entity never created still leaves a tombstone.
    emod(8, "e4-del", "entity.delete", "e4", 1, "ignored", ts(1, 1)),
]


def test_replay_entities(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    got = T.replay_entities(spark.createDataFrame(ENTITY_MODS, T.ENTITY_MODIFICATIONS_SCHEMA))
    assertDataFrameEqual(
        got,
        spark.createDataFrame(
            [
                ("e1", 3, False, "d3", "e1-v3"),
                ("e2", 2, True, None, "e2-del"),
                ("e3", 5, False, "first", "e3-first"),
                ("e4", 1, True, None, "e4-del"),
            ],
            "entity_id string, version bigint, deleted boolean, data_md5 string, request_id string",
        ),
    )


def test_a_version_tie_in_one_batch_replays_what_was_applied(spark) -> None:
    """Two requests of one entity and version completed by one statement (one
    ``completed_at``): the handler applied the first in batch order, which need not be
    the lower id (ids follow request_id order at the claim)."""
    same = ts(1, 5)
    mods = [
        emod(20, "t-a", "entity.upsert", "t", 7, "not-applied", same, False),
        emod(21, "t-b", "entity.upsert", "t", 7, "applied", same, True),
    ]
    entities = [("t", 7, False, "applied", "t-b", same)]
    got = T.entity_drift(
        spark.createDataFrame(entities, T.ENTITIES_SCHEMA),
        spark.createDataFrame(mods, T.ENTITY_MODIFICATIONS_SCHEMA),
        inflight_cutoff=CUTOFF,
        source="primary",
    )
    assert got.collect() == []


def test_entity_drift(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    mods = [
        *ENTITY_MODS,
        emod(10, "e5-v1", "entity.upsert", "e5", 1, "good", ts(1, 1)),
        emod(11, "e6-v1", "entity.upsert", "e6", 1, "good", ts(1, 1)),
        # e7: completed after the cutoff; the entity write may not be visible to our read.
        emod(12, "e7-v1", "entity.upsert", "e7", 1, "good", ts(1, 22)),
    ]
    old = ts(1, 6)
    entities = [
        ("e1", 3, False, "d3", "e1-v3", old),  # matches
        ("e2", 1, False, "x1", "e2-v1", old),  # the delete never landed
        ("e3", 5, False, "first", "e3-first", old),  # matches
        ("e4", 1, True, None, "e4-del", old),  # matches
        ("e5", 1, False, "tampered", "e5-v1", old),  # data differs
        ("e6", 1, False, "tampered", "e6-v1", ts(1, 21)),  # written after cutoff: skipped
        ("e8", 1, False, "orphan", "nobody", old),  # no modification explains it
    ]
    got = T.entity_drift(
        spark.createDataFrame(entities, T.ENTITIES_SCHEMA),
        spark.createDataFrame(mods, T.ENTITY_MODIFICATIONS_SCHEMA),
        inflight_cutoff=CUTOFF,
        source="primary",
    )
    assertDataFrameEqual(
        kinds(got),
        [
            ("entity_drift", "e2-del", "e2", "primary"),
            ("entity_drift", "e5-v1", "e5", "primary"),
            ("entity_drift", "nobody", "e8", "primary"),
        ],
    )
    details = {r["entity_id"]: json.loads(r["details"]) for r in got.collect()}
    assert details["e2"] == {
        "problem": "state_mismatch",
        "fields": ["version", "deleted", "data_md5", "request_id"],
        "expected": {"version": 2, "deleted": True, "request_id": "e2-del"},
        "actual": {"version": 1, "deleted": False, "data_md5": "x1", "request_id": "e2-v1"},
    }
    assert details["e5"]["fields"] == ["data_md5"]
    assert details["e8"] == {
        "problem": "no_completed_modification",
        "actual": {"version": 1, "deleted": False, "data_md5": "orphan", "request_id": "nobody"},
    }


def test_entity_drift_missing_entity(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    got = T.entity_drift(
        spark.createDataFrame([], T.ENTITIES_SCHEMA),
        spark.createDataFrame(ENTITY_MODS[:3], T.ENTITY_MODIFICATIONS_SCHEMA),
        inflight_cutoff=CUTOFF,
        source="peer1",
    )
    assertDataFrameEqual(
        got,
        spark.createDataFrame(
            [
                (
                    "entity_drift",
                    "e1-v3",
                    "e1",
                    "peer1",
                    '{"problem":"missing_entity","expected":{"version":3,"deleted":false,'
                    '"data_md5":"d3","request_id":"e1-v3"}}',
                )
            ],
            T.DISCREPANCY_SCHEMA,
        ),
    )


def test_count_by_kind(spark) -> None:
    from pyspark.testing import assertDataFrameEqual

    disc = spark.createDataFrame(
        [
            ("entity_drift", None, "e1", "primary", "{}"),
            ("entity_drift", None, "e2", "primary", "{}"),
            ("missing_in_peer", "r", None, "peer1", "{}"),
        ],
        T.DISCREPANCY_SCHEMA,
    )
    assertDataFrameEqual(T.count_by_kind(disc), [("entity_drift", 2), ("missing_in_peer", 1)])

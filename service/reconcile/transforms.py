"""The checks: pure DataFrame → DataFrame functions, no I/O, no collect.

Every check returns rows of :data:`DISCREPANCY_SCHEMA` (``details`` is a JSON string), so
the job can union them and the loader writes them unchanged. The input shapes are
:data:`MODIFICATIONS_SCHEMA`, :data:`ENTITY_MODIFICATIONS_SCHEMA` and
:data:`ENTITIES_SCHEMA`; ``io`` reads exactly those columns.

Time is passed in, never read: ``window`` is the half-open ``[start, end)`` on
``received_at`` being checked, ``inflight_cutoff`` is "now minus --stuck-after". Anything
younger than the cutoff may still legitimately be in flight (a claim being applied, a peer
a few seconds behind, an entity write racing our reads), so it is never reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import reduce
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pyspark is imported lazily by the callers; see the package docstring.
    from pyspark.sql import Column, DataFrame

MODIFICATIONS_SCHEMA = (
    "id bigint, request_id string, request_type string, status string, "
    "payload_sha256 string, owner string, received_at timestamp, completed_at timestamp"
)
ENTITY_MODIFICATIONS_SCHEMA = (
    "id bigint, request_id string, request_type string, entity_id string, version bigint, "
    "data_md5 string, completed_at timestamp, applied boolean"
)
ENTITIES_SCHEMA = (
    "entity_id string, version bigint, deleted boolean, data_md5 string, request_id string, "
    "updated_at timestamp"
)
DIGESTS_SCHEMA = "bucket int, n bigint, digest string"
DISCREPANCY_SCHEMA = (
    "kind string, request_id string, entity_id string, source string, details string"
)

UPSERT = "entity.upsert"
DELETE = "entity.delete"
#: The entity columns compared between ``entities`` and the state replayed from modifications.
_ENTITY_FIELDS = ("version", "deleted", "data_md5", "request_id")


@dataclass(frozen=True)
class Window:
    """Half-open ``[start, end)`` on ``received_at`` (timezone-aware UTC datetimes)."""

    start: datetime
    end: datetime


def _in_window(col: Column, window: Window) -> Column:
    return (col >= window.start) & (col < window.end)


def _discrepancy(
    df: DataFrame,
    kind: str,
    request_id: Column | None,
    entity_id: Column | None,
    source: Column | str,
    details: Column,
) -> DataFrame:
    from pyspark.sql import functions as F

    return df.select(
        *_discrepancy_columns(_Check(F.lit(True), kind, request_id, entity_id, source, details))
    )


def stuck_in_progress(
    mods: DataFrame, *, window: Window, inflight_cutoff: datetime, source: str
) -> DataFrame:
    """Claims received in the window that are still ``IN_PROGRESS`` past the threshold.

    Orphan GC should have released them (a dead owner) or the owner finished them; one
    that survives is a message the daemon is neither applying nor letting redeliver.
    """
    from pyspark.sql import functions as F

    stuck = mods.where(
        (F.col("status") == "IN_PROGRESS")
        & _in_window(F.col("received_at"), window)
        & (F.col("received_at") < F.lit(inflight_cutoff))
    )
    return _discrepancy(
        stuck,
        "stuck_in_progress",
        F.col("request_id"),
        None,
        source,
        F.struct("request_type", "owner", "received_at"),
    )


def compare_databases(
    primary: DataFrame,
    peer: DataFrame,
    *,
    window: Window,
    inflight_cutoff: datetime,
    peer_label: str,
    checked_from: datetime | None = None,
) -> DataFrame:
    """``missing_in_peer``, ``missing_in_primary``, ``status_mismatch``, ``payload_mismatch``.

    ``checked_from``: the pruning horizon. A request received before it may already be
    pruned on one side only (each database prunes on its own phase), so it is never
    reported missing; requests both sides hold are still compared.

    Both inputs may cover a wider range than ``window`` (the loader reads a margin either
    side): a request the primary received at 23:59:59 and the peer at 00:00:01 is present
    in both, not missing. Only requests with at least one side inside the window are
    judged. ``source`` is always the peer's label; the kind says which side lacks the row.
    """
    from pyspark.sql import functions as F

    p = primary.select([F.col(c).alias(f"p_{c}") for c in primary.columns])
    q = peer.select([F.col(c).alias(f"q_{c}") for c in peer.columns])
    # Spark picks the join (a sort-merge join spills; a forced hash join's tables
    # cannot, which a mass incident's volume would need).
    joined = p.join(q, F.col("p_request_id") == F.col("q_request_id"), "full_outer").where(
        _in_window(F.col("p_received_at"), window) | _in_window(F.col("q_received_at"), window)
    )
    sides = _Sides(window, inflight_cutoff, peer_label, checked_from)
    # One pass over one join: every check is a conditional row of the same select. A
    # union of one filtered frame per check would make the optimizer push each check's
    # own filters below the join, so that no exchange is shared and both sides are
    # shuffled (and the join done) once per check.
    return _checks(
        joined,
        [
            sides.missing(have="p", lack="q"),
            sides.missing(have="q", lack="p"),
            *sides.mismatches(),
        ],
    )


def differing_buckets(primary: DataFrame, peer: DataFrame) -> DataFrame:
    """``bucket`` of every bucket whose count or digest differs between two frames of
    :data:`DIGESTS_SCHEMA`, including the buckets only one side has.

    A request in any other bucket is in both databases with the same status and payload
    (short of a collision of the digests): no check of :func:`compare_databases` can fail
    for it, so only the requests of these buckets need comparing row by row.
    """
    from pyspark.sql import functions as F

    p = primary.select("bucket", F.col("n").alias("p_n"), F.col("digest").alias("p_digest"))
    q = peer.select("bucket", F.col("n").alias("q_n"), F.col("digest").alias("q_digest"))
    same = F.col("p_n").eqNullSafe(F.col("q_n")) & F.col("p_digest").eqNullSafe(F.col("q_digest"))
    return p.join(q, "bucket", "full_outer").where(~same).select("bucket")


@dataclass(frozen=True)
class _Check:
    """One check over a frame: the rows where ``when`` holds, as discrepancies."""

    when: Column
    kind: str
    request_id: Column | None
    entity_id: Column | None
    source: Column | str
    details: Column


def _checks(df: DataFrame, checks: list[_Check]) -> DataFrame:
    """The discrepancies of every check over ``df``, in one pass: each row becomes as
    many discrepancies as checks it fails (zero, one or more)."""
    from pyspark.sql import functions as F

    candidates = [
        F.when(c.when, F.struct(*_discrepancy_columns(c))) for c in checks
    ]
    # Only the rows failing some check build the array: the filter is evaluated on every
    # row of the join, the array of structs (allocated per row) on a handful.
    failing = reduce(lambda a, b: a | b, [c.when for c in checks])
    return df.where(failing).select(F.inline(F.array_compact(F.array(*candidates))))


def _discrepancy_columns(c: _Check) -> list[Column]:
    """The columns of :data:`DISCREPANCY_SCHEMA` for one check."""
    from pyspark.sql import functions as F

    src = F.lit(c.source) if isinstance(c.source, str) else c.source
    return [
        F.lit(c.kind).alias("kind"),
        (c.request_id if c.request_id is not None else F.lit(None))
        .cast("string")
        .alias("request_id"),
        (c.entity_id if c.entity_id is not None else F.lit(None)).cast("string").alias("entity_id"),
        src.cast("string").alias("source"),
        F.to_json(c.details).alias("details"),
    ]


@dataclass(frozen=True)
class _Sides:
    """The cross-database checks over a ``p_``/``q_`` (primary/peer) full outer join."""

    window: Window
    inflight_cutoff: datetime
    peer_label: str
    checked_from: datetime | None = None

    def settled(self, prefix: str) -> Column:
        from pyspark.sql import functions as F

        return F.col(f"{prefix}_received_at") < F.lit(self.inflight_cutoff)

    def missing(self, *, have: str, lack: str) -> _Check:
        """Requests only side ``have`` holds, received in the window and settled there."""
        from pyspark.sql import functions as F

        label = {"p": "primary", "q": self.peer_label}
        kind = "missing_in_peer" if lack == "q" else "missing_in_primary"
        when = (
            F.col(f"{have}_id").isNotNull()
            & ~F.col(f"{lack}_id").isNotNull()
            & _in_window(F.col(f"{have}_received_at"), self.window)
            & self.settled(have)
        )
        if self.checked_from is not None:  # older: maybe pruned on the other side only
            when &= F.col(f"{have}_received_at") >= F.lit(self.checked_from)
        return _Check(
            when,
            kind,
            F.col(f"{have}_request_id"),
            None,
            self.peer_label,
            F.struct(
                F.lit(label[have]).alias("present_in"),
                F.lit(label[lack]).alias("missing_in"),
                _side(have).alias("primary" if have == "p" else "peer"),
            ),
        )

    def mismatches(self) -> list[_Check]:
        """``status_mismatch`` and ``payload_mismatch`` of requests both sides hold."""
        from pyspark.sql import functions as F

        both = F.col("p_id").isNotNull() & F.col("q_id").isNotNull()
        # A claim younger than the threshold is simply still being applied on that side.
        in_progress_is_settled = F.when(
            F.col("p_status") == "IN_PROGRESS", self.settled("p")
        ).otherwise(self.settled("q"))
        status_mismatch = _Check(
            both & (F.col("p_status") != F.col("q_status")) & in_progress_is_settled,
            "status_mismatch",
            F.col("p_request_id"),
            None,
            self.peer_label,
            F.struct(_side("p").alias("primary"), _side("q").alias("peer")),
        )
        payload_mismatch = _Check(
            both & ~F.col("p_payload_sha256").eqNullSafe(F.col("q_payload_sha256")),
            "payload_mismatch",
            F.col("p_request_id"),
            None,
            self.peer_label,
            F.struct(
                F.col("p_payload_sha256").alias("primary_sha256"),
                F.col("q_payload_sha256").alias("peer_sha256"),
            ),
        )
        return [status_mismatch, payload_mismatch]


def _side(prefix: str) -> Column:
    """One side's row as it appears in the details of a cross-database discrepancy."""
    from pyspark.sql import functions as F

    return F.struct(
        F.col(f"{prefix}_status").alias("status"),
        F.col(f"{prefix}_request_type").alias("request_type"),
        F.col(f"{prefix}_received_at").alias("received_at"),
    )


def replay_entities(entity_mods: DataFrame) -> DataFrame:
    """The state the reference handlers must have left: per entity, the ``COMPLETED``
    ``entity.upsert``/``entity.delete`` with the highest version; on a version tie the one
    the handler applied (``applied``: ``result->>'applied'``, true before unknown before
    false), then the one completed first (a later equal version is not "strictly newer",
    so it never landed). ``applied`` decides the ties inside one batch: both rows share
    ``completed_at`` and the first in batch order, not the lower id, landed.

    Returns ``entity_id, version, deleted, data_md5, request_id``.
    """
    return _replay(entity_mods).drop("last_completed_at")


def _replay(entity_mods: DataFrame) -> DataFrame:
    """:func:`replay_entities` plus ``last_completed_at``, the latest ``completed_at`` of
    the entity's modifications (computed in the same window: no second shuffle or sort)."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    entity = W.partitionBy("entity_id")
    order = entity.orderBy(
        F.col("version").desc_nulls_last(),
        F.when(F.col("applied"), 0).when(~F.col("applied"), 2).otherwise(1).asc(),
        F.col("completed_at").asc_nulls_last(),
        F.col("id").asc(),
    )
    # The whole entity as the max's frame, over the same partitioning and order as the
    # rank: one Window operator computes both (over ``entity`` alone it took a second).
    whole = order.rowsBetween(W.unboundedPreceding, W.unboundedFollowing)
    winners = (
        entity_mods.where(F.col("entity_id").isNotNull())
        .withColumn("_rank", F.row_number().over(order))
        .withColumn("_last_completed_at", F.max("completed_at").over(whole))
        .where(F.col("_rank") == 1)
    )
    is_delete = F.col("request_type") == DELETE
    return winners.select(
        "entity_id",
        "version",
        is_delete.alias("deleted"),
        F.when(is_delete, F.lit(None).cast("string"))
        .otherwise(F.col("data_md5"))
        .alias("data_md5"),
        "request_id",
        F.col("_last_completed_at").alias("last_completed_at"),
    )


def entity_drift(
    entities: DataFrame,
    entity_mods: DataFrame,
    *,
    inflight_cutoff: datetime,
    source: str,
) -> DataFrame:
    """``entities`` rows that differ from the replayed state, in both directions.

    ``details.problem`` is ``missing_entity`` (modifications completed, no row),
    ``no_completed_modification`` (a row nothing explains) or ``state_mismatch`` with the
    differing ``fields``. Entities written or modified after the cutoff are skipped: our
    reads of the two tables are not one snapshot, so a write racing them is not drift.
    """
    from pyspark.sql import functions as F

    fields = _ENTITY_FIELDS
    joined = _settled_states(entities, entity_mods, inflight_cutoff)
    differing = F.array_compact(
        F.array(*[F.when(~F.col(f"e_{c}").eqNullSafe(F.col(f"r_{c}")), F.lit(c)) for c in fields])
    )
    e_present, r_present = F.col("e_entity_id").isNotNull(), F.col("r_entity_id").isNotNull()
    problem = (
        F.when(~e_present, F.lit("missing_entity"))
        .when(~r_present, F.lit("no_completed_modification"))
        .otherwise(F.lit("state_mismatch"))
    )
    drifted = joined.withColumn("_fields", differing).where(
        ~e_present | ~r_present | (F.size("_fields") > 0)
    )

    def state(prefix: str) -> Column:
        present = e_present if prefix == "e" else r_present
        return F.when(present, F.struct(*[F.col(f"{prefix}_{c}").alias(c) for c in fields]))

    return _discrepancy(
        drifted,
        "entity_drift",
        F.coalesce("r_request_id", "e_request_id"),
        F.col("entity_id"),
        source,
        F.struct(
            problem.alias("problem"),
            F.when(e_present & r_present, F.col("_fields")).alias("fields"),
            state("r").alias("expected"),
            state("e").alias("actual"),
        ),
    )


def _settled_states(
    entities: DataFrame, entity_mods: DataFrame, inflight_cutoff: datetime
) -> DataFrame:
    """Per ``entity_id``, the actual (``e_``) and the replayed (``r_``) state side by side,
    without the entities written or modified after the cutoff."""
    from pyspark.sql import functions as F

    cutoff = F.lit(inflight_cutoff)
    fields = _ENTITY_FIELDS
    e = entities.select(
        F.col("entity_id").alias("e_entity_id"),
        *[F.col(c).alias(f"e_{c}") for c in fields],
        F.col("updated_at").alias("e_updated_at"),
    )
    r = _replay(entity_mods).select(
        F.col("entity_id").alias("r_entity_id"),
        *[F.col(c).alias(f"r_{c}") for c in fields],
        F.col("last_completed_at").alias("r_last_completed_at"),
    )
    joined = e.join(r, F.col("e_entity_id") == F.col("r_entity_id"), "full_outer").withColumn(
        "entity_id", F.coalesce("e_entity_id", "r_entity_id")
    )
    # Unsettled: a modification of the entity completed at or after the cutoff, or its row
    # written then. Both sides of the join carry what decides it, so it is a filter, not
    # a second read of both tables and an anti-join.
    unsettled = F.coalesce(F.col("r_last_completed_at") >= cutoff, F.lit(False)) | F.coalesce(
        F.col("e_updated_at") >= cutoff, F.lit(False)
    )
    return joined.where(~unsettled)


def union_discrepancies(frames: Iterable[DataFrame]) -> DataFrame:
    """All discrepancy frames as one (they share :data:`DISCREPANCY_SCHEMA`)."""
    frames = list(frames)
    if not frames:
        raise ValueError("no discrepancy frames to union")
    return reduce(lambda a, b: a.unionByName(b), frames)


def count_by_kind(discrepancies: DataFrame) -> DataFrame:
    """``kind, n`` — a handful of rows, safe to collect whatever the discrepancy volume."""
    return discrepancies.groupBy("kind").count().withColumnRenamed("count", "n")

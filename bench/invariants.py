"""The promises kvledger makes under faults, checked against a running :class:`bench.cluster.Cluster`.

One checker for the fault-injection suite (``tests/faults``) and ``kvledger bench soak``:

1. **Ledger = nodes.** For every running node, the ledger's live placements equal the node's own
   ``Inventory`` (asked for with a signed ``InventoryRequested``), compared at a moment when the ledger
   had applied every event the node published before that inventory.
2. **Nothing superseded is served.** Probes made after a command completed (:meth:`Invariants.probe_erased`,
   :meth:`Invariants.probe_stale_document`, :meth:`Invariants.probe_stale_policy`): an erased subject's
   request hits no more than a never-seen subject's identical request; a request naming a replaced
   document version is refused (409), a token of a revoked policy version too (401).
3. **Erasures.** Every erasure eventually ``verified``; a verified erasure leaves no copy of the
   subject's blocks created before its cutoff, neither in the ledger nor in any node's inventory
   (on the nodes, also no public or tenant copy the subject's request created).
4. **Nothing applied twice.** One content per ``(node, epoch, seq)`` on ``kvledger.kv-events`` (a retry
   resends identical bytes; heartbeats, which repeat the last seq, aside); per node and epoch the
   published ``seq`` values have no hole.
5. **Nothing lost.** Every kv-event and ack on the topics is in the ledger's inbox, or dead-lettered and
   counted (``dead_letters``).

Replicas (copies a node pulled from a peer, ``gpu_node.cache.peers``) are placements like any other, so 1 and 3
cover them; each check also counts the live ones (:attr:`Invariants.num_replicas`) so a report shows how
many copies those promises held for.

Each check returns human-readable violations (an empty list when the promise holds), so the soak can
count them and the tests can assert on them with the details in the failure message.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field

import asyncpg
import openai

from bench.cluster import Cluster, TopicRecord
from events import schema

SETTLE_TIMEOUT_S = 120.0


@dataclass
class Invariants:
    cluster: Cluster
    served_violations: list[str] = field(default_factory=list)
    num_probes: int = 0
    num_checks: int = 0
    num_replicas: int = 0
    """Live placements of pulled copies at the last :meth:`check`."""

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(**self.cluster.connect_kwargs(), timeout=10)

    async def _query(self, sql: str, *args) -> list[asyncpg.Record]:
        connection = await self._connect()
        try:
            return await connection.fetch(sql, *args)
        finally:
            await connection.close()

    # -- settling ---------------------------------------------------------------------

    async def unsettled(self) -> list[str]:
        """What is still in progress: open invalidations, unverified erasures, unpublished outbox
        rows."""
        rows = await self._query(
            "SELECT 'invalidation ' || status AS what, count(*) AS n FROM invalidations WHERE status <> 'complete' GROUP BY status"
            " UNION ALL SELECT 'erasure ' || status, count(*) FROM erasures WHERE status <> 'verified' GROUP BY status"
            " UNION ALL SELECT 'outbox unsent', count(*) FROM outbox WHERE sent_at IS NULL HAVING count(*) > 0"
        )
        return [f"{row['n']} {row['what']}" for row in rows]

    async def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> list[str]:
        """Wait until nothing is in progress; violations naming what never finished."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                left = await self.unsettled()
            except (OSError, asyncpg.PostgresError) as error:
                left = [f"ledger unreachable ({type(error).__name__})"]
            if not left:
                return []
            if time.monotonic() > deadline:
                return [f"not settled after {timeout_s:.0f}s: {', '.join(left)}"]
            await asyncio.sleep(0.2)

    # -- 3. erasures ------------------------------------------------------------------

    async def live_replicas(self) -> int:
        """Live placements whose node's copy was pulled from a peer (a ``replicas`` row names its
        source)."""
        rows = await self._query(
            "SELECT count(*) AS n FROM placements p JOIN replicas r ON r.block_hash = p.block_hash AND r.node_id = p.node_id"
            " WHERE p.state = 'live'"
        )
        return int(rows[0]["n"])

    async def erased_copies_in_ledger(self) -> list[str]:
        """Live placements of a verified erasure's subject whose copy was built before the erasure's
        cutoff.

        The ledger keeps a block's first ``created_at``; the same hash built again after the erasure
        (the subject came back) is a new copy, told apart by the build time its node reported. A
        snapshot copy is a copy of what the pool held when the snapshot was written: excused only
        when the node reported a build after the cutoff no later than it first announced that
        snapshot (its ``SnapshotWritten``, or an inventory listing it) — a snapshot written before
        the rebuild is never."""
        rows = await self._query(
            "SELECT e.id, e.cutoff, p.node_id, p.tier, p.snapshot_id, encode(p.block_hash, 'hex') AS block, n.epoch, n.last_seq"
            " FROM erasures e"
            " JOIN blocks b ON b.tenant_id = e.tenant_id AND b.subject_hash = e.subject_hash AND b.created_at < e.cutoff"
            " JOIN placements p ON p.block_hash = b.block_hash AND p.state = 'live'"
            " JOIN nodes n ON n.node_id = p.node_id"
            " WHERE e.status = 'verified'"
        )
        if not rows:
            return []
        # The build times come from the tail, which reads the topic apart from the coordinator: a
        # rebuild the ledger applied a moment ago may not be in the tail yet. Judge only once the
        # tail read what the ledger applied.
        await self._tail_caught_up(
            {(row["node_id"], row["epoch"]): row["last_seq"] for row in rows}
        )
        rebuilt, announced = self._builds(), self._snapshots_announced()

        def rebuilt_after_cutoff(row: asyncpg.Record) -> bool:
            builds = rebuilt.get((row["node_id"], row["block"]), ())
            if row["tier"] != "snapshot":
                return any(built >= row["cutoff"] for _, built in builds)
            written = announced.get((row["node_id"], row["snapshot_id"]))
            return written is not None and any(
                built >= row["cutoff"] and index <= written for index, built in builds
            )

        left = collections.Counter(
            (row["id"], row["node_id"], row["tier"])
            for row in rows
            if not rebuilt_after_cutoff(row)
        )
        return [
            f"erasure {erasure} verified but the ledger holds {n} live {tier} copies on {node}"
            for (erasure, node, tier), n in left.items()
        ]

    async def _tail_caught_up(
        self, applied: dict[tuple[str, int], int], timeout_s: float = 30.0
    ) -> None:
        """Wait until the tail holds, for each (node, epoch), the record of the ledger's last applied ``seq``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen: dict[tuple[str, int], int] = {}
            for record in self.cluster.tail.kv_events:
                payload = record.envelope.payload
                key = (getattr(payload, "node_id", None), getattr(payload, "epoch", None))
                if key in applied:
                    seen[key] = max(seen.get(key, -1), payload.seq)
            if all(seen.get(key, -1) >= last_seq for key, last_seq in applied.items()):
                return
            await asyncio.sleep(0.2)

    def _builds(self) -> dict[tuple[str, str], list]:
        """(node, block hash) → (position in the tail, build time) of every build the node reported for it
        (``BlockStored``, inventories). A node's records share one partition, so its positions are its publish order."""
        builds: dict[tuple[str, str], list] = collections.defaultdict(list)
        for index, record in enumerate(self.cluster.tail.kv_events):
            payload = record.envelope.payload
            if isinstance(payload, (schema.BlockStored, schema.Inventory)):
                for block in payload.blocks:
                    builds[(payload.node_id, block.block_hash)].append((index, block.created_at))
        return builds

    def _snapshots_announced(self) -> dict[tuple[str, str], int]:
        """(node, snapshot id) → position in the tail of the first record naming it: its
        ``SnapshotWritten``, or the first inventory listing it (a node killed before it published
        the ``SnapshotWritten`` lists it at restart)."""
        announced: dict[tuple[str, str], int] = {}
        for index, record in enumerate(self.cluster.tail.kv_events):
            payload = record.envelope.payload
            if isinstance(payload, schema.SnapshotWritten):
                announced.setdefault((payload.node_id, payload.snapshot_id), index)
            elif isinstance(payload, schema.Inventory):
                for placement in payload.placements:
                    if placement.snapshot_id is not None:
                        announced.setdefault((payload.node_id, placement.snapshot_id), index)
        return announced

    async def _verified_erasures(self) -> list[asyncpg.Record]:
        return await self._query(
            "SELECT id, tenant_id, encode(subject_hash, 'hex') AS subject, cutoff FROM erasures WHERE status = 'verified'"
        )

    # -- 1. ledger = every node's inventory ---------------------------------------------

    async def _ledger_view(self, node_id: str) -> tuple[int, int, set[tuple[str, str, str | None]]]:
        connection = await self._connect()
        try:
            async with connection.transaction(isolation="repeatable_read"):
                node = await connection.fetchrow(
                    "SELECT epoch, last_seq FROM nodes WHERE node_id = $1", node_id
                )
                rows = await connection.fetch(
                    "SELECT encode(block_hash, 'hex') AS block, tier, snapshot_id FROM placements WHERE node_id = $1 AND state = 'live'",
                    node_id,
                )
        finally:
            await connection.close()
        assert node is not None, f"{node_id} is not in the ledger"
        return (
            node["epoch"],
            node["last_seq"],
            {(row["block"], row["tier"], row["snapshot_id"]) for row in rows},
        )

    async def node_inventory(self, node_id: str, timeout_s: float = 60.0) -> list[schema.Envelope]:
        """The node's own account of what it holds (every chunk of one fresh ``Inventory``)."""
        tail = self.cluster.tail
        assert tail is not None
        request_id = await self.cluster.request_inventory(node_id)
        deadline = time.monotonic() + timeout_s
        while (chunks := tail.inventory(node_id, request_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node_id} sent no inventory within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        return [chunk.envelope for chunk in chunks]

    async def placements_match(
        self, node_id: str, attempts: int = 10
    ) -> tuple[list[str], list[schema.Envelope]]:
        """Ledger placements of ``node_id`` == its inventory, taken when the ledger had applied
        everything before it. Returns the violations and the inventory compared.

        Only records the node published between the ledger's last applied ``seq`` and the
        inventory may separate the two views; when any of them is more than a heartbeat,
        the comparison is retried (the node was still busy), never reported as a violation.
        """
        tail = self.cluster.tail
        for _ in range(attempts):
            epoch, last_seq, ledger = await self._ledger_view(node_id)
            inventory = await self.node_inventory(node_id)
            first = inventory[0].payload
            between = [
                record.envelope.payload
                for record in tail.kv_events
                if getattr(record.envelope.payload, "node_id", None) == node_id
                and record.envelope.payload.epoch == first.epoch
                and last_seq < record.envelope.payload.seq < first.seq
            ]
            if epoch != first.epoch or any(
                not isinstance(payload, schema.NodeHeartbeat) for payload in between
            ):
                await asyncio.sleep(0.5)
                continue
            held = {
                (placement.block_hash, placement.tier, placement.snapshot_id)
                for chunk in inventory
                for placement in chunk.payload.placements
            }
            if held == ledger:
                return [], inventory
            only_ledger, only_node = sorted(ledger - held), sorted(held - ledger)
            return [
                f"{node_id}: the ledger and the node disagree: {len(only_ledger)} placements only in the ledger "
                f"(e.g. {only_ledger[:3]}), {len(only_node)} only on the node (e.g. {only_node[:3]})"
            ], inventory
        return [
            f"{node_id}: never quiet enough to compare the ledger with its inventory ({attempts} attempts)"
        ], inventory

    async def erased_copies_on_nodes(
        self, inventories: dict[str, list[schema.Envelope]]
    ) -> list[str]:
        violations = []
        for erasure in await self._verified_erasures():
            for node_id, chunks in inventories.items():
                left = [
                    block.block_hash
                    for chunk in chunks
                    for block in chunk.payload.blocks
                    if (
                        (
                            block.tenant_id == erasure["tenant_id"]
                            and block.subject_id == erasure["subject"]
                        )
                        or block.creator_subject_id
                        == erasure[
                            "subject"
                        ]  # a public or tenant block the subject's request built
                    )
                    and block.created_at < erasure["cutoff"]
                ]
                if left:
                    violations.append(
                        f"erasure {erasure['id']} verified but {node_id} still holds {len(left)} of the subject's blocks"
                    )
        return violations

    # -- 4. and 5. the event streams ----------------------------------------------------

    def kv_events_exact(self) -> list[str]:
        tail = self.cluster.tail
        contents: dict[tuple[str, int, int], dict[bytes, TopicRecord]] = collections.defaultdict(
            dict
        )
        seqs: dict[tuple[str, int], set[int]] = collections.defaultdict(set)
        for record in tail.kv_events:
            payload = record.envelope.payload
            if isinstance(payload, schema.NodeHeartbeat):
                continue  # a heartbeat repeats the last seq the node sent; it takes none of its own
            key = (payload.node_id, payload.epoch, payload.seq)
            contents[key].setdefault(record.value, record)
            seqs[key[:2]].add(payload.seq)
        violations = [
            f"{len(records)} different records under (node, epoch, seq) {key}: "
            + "; ".join(
                f"{r.envelope.type} {r.envelope.event_id} at {r.partition}/{r.offset}"
                for r in records.values()
            )
            for key, records in contents.items()
            if len(records) > 1
        ]
        for (node_id, epoch), published in seqs.items():
            holes = sorted(set(range(max(published) + 1)) - published)
            if holes:
                violations.append(
                    f"{node_id} epoch {epoch}: seq {holes[:5]} never published (of {len(holes)} holes)"
                )
        return violations

    async def nothing_lost(self, timeout_s: float = 30.0) -> list[str]:
        """Every kv-event and ack on the topics went through the inbox, or was dead-lettered and
        counted.

        Waits up to ``timeout_s`` for the coordinator to consume what was published last (the
        inventories the checks themselves asked for among them).
        """
        tail = self.cluster.tail
        deadline = time.monotonic() + timeout_s
        while True:
            published = {
                record.envelope.event_id: record.envelope.type
                for record in (*tail.kv_events, *tail.acks)
            }
            if not published:
                return []
            rows = await self._query(
                "SELECT event_id FROM inbox WHERE event_id = ANY($1::uuid[])", list(published)
            )
            missing = set(published) - {row["event_id"] for row in rows}
            dead = await self._query(
                "SELECT coalesce(sum(num_records), 0) AS n FROM dead_letters WHERE topic IN ('kvledger.kv-events', 'kvledger.acks')"
            )
            if len(missing) <= dead[0]["n"]:
                return []
            if time.monotonic() > deadline:
                types = collections.Counter(published[event_id] for event_id in missing)
                return [
                    f"{len(missing)} kv-events/acks neither applied nor dead-lettered ({dead[0]['n']} dead letters counted): {dict(types)}"
                ]
            await asyncio.sleep(0.2)

    async def taken_over(
        self, partitions: set[int], since_ms: int, until_ms: int, grace_ms: int = 5000
    ) -> tuple[int, list[str]]:
        """Partition takeover: the coordinator that owned kv-events ``partitions`` was dead from
        ``since_ms`` to ``until_ms`` (wall clock); on each of them, the first kv-event published in
        that window (up to ``grace_ms`` before its end: the survivor must notice the death, rejoin
        and catch up first) was applied before ``until_ms`` — so by another member. That nothing was
        lost or applied twice is :meth:`nothing_lost`'s and :meth:`kv_events_exact`'s.

        Returns how many of the window's records on ``partitions`` were applied before ``until_ms``,
        and the violations."""
        records = [
            record
            for record in self.cluster.tail.kv_events
            if record.partition in partitions and since_ms <= record.timestamp_ms < until_ms
        ]
        if not records:
            return 0, []
        rows = await self._query(
            "SELECT event_id FROM inbox WHERE event_id = ANY($1::uuid[]) AND processed_at < to_timestamp($2::float8 / 1000)",
            [record.envelope.event_id for record in records],
            float(until_ms),
        )
        applied = {row["event_id"] for row in rows}
        violations = []
        for partition in sorted(partitions):
            first = min(
                (
                    r
                    for r in records
                    if r.partition == partition and r.timestamp_ms < until_ms - grace_ms
                ),
                key=lambda r: r.offset,
                default=None,
            )
            if first is not None and first.envelope.event_id not in applied:
                violations.append(
                    f"kv-events partition {partition}: a record published {(first.timestamp_ms - since_ms) / 1000:.1f}s after its"
                    f" coordinator died was not applied in the {(until_ms - since_ms) / 1000:.1f}s until it came back:"
                    " nobody took the partition over"
                )
        return sum(record.envelope.event_id in applied for record in records), violations

    # -- 2. probes -------------------------------------------------------------------

    async def probe_erased(
        self, node_index: int, tenant: str, subject: str, messages: list[dict]
    ) -> None:
        """After ``subject``'s erasure verified: its request may hit no more than a never-seen
        subject's identical one.

        The allowance is the most that strangers get just before and just after it: the public
        prefix comes and goes under the soak's traffic (an erasure also removes the public blocks
        its subject created, and the next caller builds them again), so a stranger's answer alone
        can miss what the erased subject's request, a moment later, legitimately hits. One try
        only: the erased subject's request caches its own blocks anew, so a second would hit them."""
        cluster = self.cluster

        async def stranger_hit() -> int:
            stranger = f"probe-{uuid.uuid4().hex[:8]}"
            answer = await cluster.chat(node_index, cluster.user_token(tenant, stranger), messages)
            return answer.usage.prompt_tokens_details.cached_tokens

        await stranger_hit()  # the first stranger caches the public prefix (if it was not)
        before = await stranger_hit()
        erased = await cluster.chat(node_index, cluster.user_token(tenant, subject), messages)
        after = await stranger_hit()
        self.num_probes += 1
        hit, allowed = erased.usage.prompt_tokens_details.cached_tokens, max(before, after)
        if hit > allowed:
            self.served_violations.append(
                f"{cluster.node_ids[node_index]} served {hit} cached tokens to an erased subject"
                f" (fresh subjects get {before} before and {after} after)"
            )

    async def probe_stale_document(
        self, node_index: int, tenant: str, messages: list[dict], scopes: dict[str, int]
    ) -> None:
        """After a document update completed: a request naming the old version is refused with 409
        ``stale_document_version``."""
        cluster = self.cluster
        self.num_probes += 1
        try:
            await cluster.chat(node_index, cluster.user_token(tenant, "reader", scopes), messages)
        except openai.APIStatusError as error:
            if error.status_code == 409 and "stale_document_version" in str(error.body):
                return
            self.served_violations.append(
                f"{cluster.node_ids[node_index]} answered a stale document request with {error.status_code}"
            )
            return
        self.served_violations.append(
            f"{cluster.node_ids[node_index]} served a document version that an update had replaced"
        )

    async def probe_stale_policy(
        self, node_index: int, tenant: str, messages: list[dict], stale_scopes: dict[str, int]
    ) -> None:
        """After a revocation completed: a token of the old policy version is refused with 401
        ``stale_authorization``."""
        cluster = self.cluster
        self.num_probes += 1
        try:
            await cluster.chat(
                node_index, cluster.user_token(tenant, "reader", stale_scopes), messages
            )
        except openai.APIStatusError as error:
            if error.status_code == 401 and "stale_authorization" in str(error.body):
                return
            self.served_violations.append(
                f"{cluster.node_ids[node_index]} answered a revoked policy's token with {error.status_code}"
            )
            return
        self.served_violations.append(
            f"{cluster.node_ids[node_index]} served a token of a revoked policy version"
        )

    # -- all of them -------------------------------------------------------------------

    async def check(self, settle_timeout_s: float = SETTLE_TIMEOUT_S) -> list[str]:
        """Every invariant, once the system settled (or the violations saying it did not)."""
        self.num_checks += 1
        violations = await self.settle(settle_timeout_s)
        violations += await self.erased_copies_in_ledger()
        self.num_replicas = await self.live_replicas()
        inventories = {}
        for node_id, node in zip(self.cluster.node_ids, self.cluster.nodes, strict=True):
            if node.running:
                found, inventories[node_id] = await self.placements_match(node_id)
                violations += found
        violations += await self.erased_copies_on_nodes(inventories)
        violations += self.kv_events_exact()
        violations += await self.nothing_lost()
        violations += self.served_violations
        return violations

"""Topic creation: the project's topics with their configurations, created idempotently at start."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.topics import ALL_TOPICS, TOPIC_CONFIGS


def new_topics(
    settings: KafkaSettings, names: Iterable[str], configs: Mapping[str, Mapping[str, str]]
) -> list[NewTopic]:
    """The creation requests of ``names``, each with its configs (none for a name ``configs``
    lacks)."""
    return [
        NewTopic(
            name=name,
            num_partitions=settings.num_partitions,
            replication_factor=settings.replication_factor,
            topic_configs=dict(configs.get(name, {})),
        )
        for name in names
    ]


async def ensure_topics(
    settings: KafkaSettings,
    topics: Iterable[str] = ALL_TOPICS,
    timeout_s: float = 30.0,
    configs: Mapping[str, Mapping[str, str]] = TOPIC_CONFIGS,
) -> list[str]:
    """Create the topics that do not exist yet, with their ``configs``, and wait until their metadata is served.

    Returns the names this call created. Safe to run concurrently from several processes:
    losing a creation race (``TopicAlreadyExists``) counts as success. A topic that exists
    keeps the configs it has: changing a live topic's retention is the operator's call
    (docs/operations.md, "Topics").
    """
    wanted = list(dict.fromkeys(topics))
    admin = AIOKafkaAdminClient(**kafka_client_kwargs(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [topic for topic in wanted if topic not in existing]
        created: list[str] = []
        if missing:
            response = await admin.create_topics(new_topics(settings, missing, configs))
            for topic, code, *_ in response.topic_errors:
                error = for_code(code)
                if code == 0:
                    created.append(topic)
                elif error is not TopicAlreadyExistsError:
                    raise error(f"cannot create topic {topic}")
        await _wait_for_topics(admin, wanted, timeout_s)
        return created
    finally:
        await admin.close()


async def _wait_for_topics(admin: AIOKafkaAdminClient, topics: list[str], timeout_s: float) -> None:
    """Poll metadata until every topic reports partitions without error (creation is asynchronous in
    Kafka)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        described = await admin.describe_topics(topics)
        ready = {t["topic"] for t in described if t["error_code"] == 0 and t["partitions"]}
        if ready >= set(topics):
            return
        if loop.time() >= deadline:
            raise TimeoutError(
                f"topics not ready after {timeout_s}s: {sorted(set(topics) - ready)}"
            )
        await asyncio.sleep(0.1)

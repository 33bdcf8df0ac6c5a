"""Topics are created with the configs chosen for each (``events.topics.TOPIC_CONFIGS``), on the
session's broker.

The embedded broker (Tansu) reports a topic's configs through DescribeConfigs, so the
test reads back what the broker stored, not only what was asked for.
"""

from __future__ import annotations

import uuid

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from events.kafka.admin import ensure_topics, new_topics
from events.kafka.settings import KafkaSettings
from events.topics import ALL_TOPICS, COMMANDS, DEAD_LETTER, TOPIC_CONFIGS


async def described_configs(bootstrap: str, names: list[str]) -> dict[str, dict[str, str]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
        )
    finally:
        await admin.close()
    configs: dict[str, dict[str, str]] = {}
    for response in responses:
        for error_code, _, _, name, entries in response.resources:
            assert error_code == 0, f"describe_configs({name}) failed with {error_code}"
            configs[name] = {entry[0]: entry[1] for entry in entries}
    return configs


def test_every_topic_has_chosen_configs_and_the_create_request_carries_them() -> None:
    assert set(TOPIC_CONFIGS) == set(ALL_TOPICS)
    assert TOPIC_CONFIGS[COMMANDS] == {"cleanup.policy": "delete", "retention.ms": "-1"}, (
        "commands are kept forever"
    )
    requests = {
        topic.name: topic.topic_configs
        for topic in new_topics(KafkaSettings(bootstrap="broker:9092"), ALL_TOPICS, TOPIC_CONFIGS)
    }
    assert requests == TOPIC_CONFIGS
    assert [
        topic.topic_configs
        for topic in new_topics(KafkaSettings(bootstrap="broker:9092"), ["other"], TOPIC_CONFIGS)
    ] == [{}]


async def test_created_topics_take_their_configs(kafka_bootstrap: str) -> None:
    """Fresh names standing for each project topic (the session's own topics may predate this run)."""
    suffix = uuid.uuid4().hex[:6]
    names = {f"{topic}-{suffix}": topic for topic in ALL_TOPICS}
    plain = f"plain-{suffix}"
    settings = KafkaSettings(bootstrap=kafka_bootstrap)
    configs = {name: TOPIC_CONFIGS[topic] for name, topic in names.items()}
    created = await ensure_topics(settings, [*names, plain], configs=configs)
    assert sorted(created) == sorted([*names, plain])

    described = await described_configs(kafka_bootstrap, [*names, plain])
    for name, topic in names.items():
        assert {key: described[name].get(key) for key in TOPIC_CONFIGS[topic]} == TOPIC_CONFIGS[
            topic
        ], name
    assert described[plain].get("retention.ms") != TOPIC_CONFIGS[DEAD_LETTER]["retention.ms"]
    assert await ensure_topics(settings, [*names, plain], configs=configs) == [], (
        "existing topics are left as they are"
    )

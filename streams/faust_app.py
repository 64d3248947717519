"""The faust host: the same processors as faust-streaming agents over the Kafka topic.

Positions live in PostgreSQL, written with each batch's outputs (``ProcessorHost.apply``), not
in faust's consumer offsets: events below a processor's saved position are skipped, so a
redelivery after a crash changes nothing. Faust runs without ``exactly_once`` (the Kafka-protocol
test broker does not support it, and the positions make it unnecessary) and with no tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import faust

from core.events.privacy import Cipher
from core.log import DeadLetter, LogPosition
from core.mapper import Mapper
from core.settings import Settings
from streams.host import ProcessorHost


def faust_app(
    settings: Settings, hosts: list[ProcessorHost], app_id: str, cipher: Cipher
) -> faust.App:
    datadir = settings.home / "faust" / app_id
    datadir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        app_id,
        broker=f"kafka://{settings.kafka_servers}",
        store="memory://",
        datadir=str(datadir),
        autodiscover=False,
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=6.0,
        key_serializer="raw",
        value_serializer="raw",
    )
    topic = app.topic(settings.kafka_topic, key_serializer="raw", value_serializer="raw")
    for host in hosts:
        app.agent(topic, name=host.processor.name)(_agent(host, cipher))
    return app


def _agent(host: ProcessorHost, cipher: Cipher) -> Any:
    mapper = Mapper(cipher)

    async def process(stream: faust.StreamT[bytes]) -> AsyncIterator[None]:
        async for event in stream.events():
            message = event.message
            position = LogPosition(message.partition, message.offset)
            decoded = mapper.decode_stored(position, event.value)
            if isinstance(decoded, DeadLetter):
                await asyncio.to_thread(host.skip, decoded)
            else:
                await asyncio.to_thread(host.apply, [decoded])
            yield None

    return process


def run_worker(settings: Settings, hosts: list[ProcessorHost], app_id: str, cipher: Cipher) -> None:
    """Run the agents until the process is told to stop (SIGINT or SIGTERM); events are
    opened with ``cipher``, as every log opens them."""
    app = faust_app(settings, hosts, app_id, cipher)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()

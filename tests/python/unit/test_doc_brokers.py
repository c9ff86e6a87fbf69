"""The TOML examples of docs/brokers.md load as the page says: each [consume] table through
load_consume_config, the [destinations] tables through load_config (no broker is contacted:
nothing connects before the first delivery)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT

from pginbox.consumer import load_consume_config
from pginbox.transports import load_config

PAGE = Path(REPO_ROOT) / "docs" / "brokers.md"


def toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", PAGE.read_text(), re.S)


def test_every_toml_example_loads(tmp_path: Path) -> None:
    blocks = toml_blocks()
    consume = [b for b in blocks if b.lstrip().startswith("[consume]")]
    destinations = [b for b in blocks if "[destinations." in b]
    assert len(consume) == 2 and len(destinations) == 1 and len(blocks) == 3
    brokers = []
    for i, block in enumerate(consume):
        path = tmp_path / f"consume{i}.toml"
        path.write_text(block)
        config = load_consume_config(path)
        brokers.append(config.broker)
        assert config.consumer == "billing"
    assert brokers == ["rabbitmq", "redis"]
    path = tmp_path / "destinations.toml"
    path.write_text(destinations[0])
    transports: dict[str, Any] = load_config(path, environ={}, use_entry_points=False)
    try:
        assert {name: type(t).__name__ for name, t in transports.items()} == {
            "orders": "RabbitMQTransport",
            "events": "JetStreamTransport",
            "feed": "RedisStreamsTransport",
        }
        assert transports["feed"].publisher.maxlen == 1000000 and transports["orders"].producer == "shop"
    finally:
        for transport in transports.values():
            transport.close()

"""One partition's keys and tags (``Partition.keys``), and their form in a checkpoint.

Plain data, no controller logic (that is ``parts._user_keys.Keys``): key -> sample index (-1 for a key
made with tags only), index -> key, tags per sample and per key without a sample. Tags are
MessagePack values, so a checkpoint keeps the index as MessagePack (base64 in the partition's
JSON header): nothing in it is code.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

Tags = dict[str, Any]


class KeyIndex:
    __slots__ = ("index", "key_of", "key_tags", "sample_tags")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.sample_tags: dict[int, Tags] = {}
        self.key_tags: dict[str, Tags] = {}  # keys without a sample

    def tags_of_key(self, key: str) -> Tags | None:
        """The tags of ``key`` (its sample's, once it has one); None for an unknown key."""
        if key not in self.index:
            return None
        i = self.index[key]
        return self.key_tags.get(key, {}) if i < 0 else self.sample_tags.get(i, {})

    def encode(self) -> str:
        state = [list(self.index.items()), list(self.sample_tags.items()), list(self.key_tags.items())]
        return base64.b64encode(msgspec.msgpack.encode(state)).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> KeyIndex:
        index, sample_tags, key_tags = msgspec.msgpack.decode(base64.b64decode(text))
        out = cls()
        out.index = {str(k): int(i) for k, i in index}
        out.key_of = {i: k for k, i in out.index.items() if i >= 0}
        out.sample_tags = {int(i): dict(t) for i, t in sample_tags}
        out.key_tags = {str(k): dict(t) for k, t in key_tags}
        return out

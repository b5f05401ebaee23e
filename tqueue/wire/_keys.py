"""Keys and tags on the wire: a partition's index from user keys to samples, and each sample's
tags (a small dict of MessagePack values, replaced as a whole when written).

``ResetConsumption`` lets a task read again what it consumed.

A key names at most one sample of a partition; a key may also exist before its sample does
(written with tags only). Tags belong to a sample (``SetTags``) or to a key (``TagKeys``),
which are the same once the key has its sample. Nothing here leases: lookups return metas
that any reader may fetch, as ``Select`` does.
"""

from __future__ import annotations

from typing import Any

from ._messages import BatchMeta, Kind, Message, register

Tags = dict[str, Any]


class BindKeys(Message):
    """Name samples of ``partition`` by ``keys`` (one per index, in order), and with ``tags``
    (one per key) replace their tags. A key that names another live sample is refused
    (``InvalidArgumentError``); one that exists without a sample gets this one, and keeps its
    tags unless ``tags`` are given."""

    KIND = Kind.BIND_KEYS
    partition: str
    keys: list[str]
    indexes: list[int]
    tags: list[Tags] | None = None


class TagKeys(Message):
    """Replace the tags of ``keys`` (one dict each); a key not known yet is made, without a
    sample, and so is the partition if there is none (a put of tags only)."""

    KIND = Kind.TAG_KEYS
    partition: str
    keys: list[str]
    tags: list[Tags]


class SetTags(Message):
    """Replace the tags of the samples ``indexes`` (one dict each) of ``partition``."""

    KIND = Kind.SET_TAGS
    partition: str
    indexes: list[int]
    tags: list[Tags]


class LookupKeys(Message):
    """Where ``keys`` are (or, with ``by_index``, which keys the samples ``indexes`` have), with
    their tags, and a meta of those with a live sample for ``fields`` (none: every field they
    all have). ``keys`` None: every key of the partition."""

    KIND = Kind.LOOKUP_KEYS
    partition: str
    keys: list[str] | None = None
    indexes: list[int] | None = None
    fields: list[str] | None = None


class KeysFound(Message):
    """Per asked key (or index): ``keys``, ``indexes`` (-1: no live sample), ``tags`` (None:
    the key is not known, or the sample has no key and no tags), and ``meta``: the samples
    found, in the order asked, for the fields asked (None when none was found)."""

    KIND = Kind.KEYS_FOUND
    keys: list[str | None]
    indexes: list[int]
    tags: list[Tags | None]
    meta: BatchMeta | None = None


class ListKeys(Message):
    """Every key with its tags, of ``partition`` or (None) of every partition."""

    KIND = Kind.LIST_KEYS
    partition: str | None = None


class KeyListing(Message):
    KIND = Kind.KEY_LISTING
    partitions: dict[str, dict[str, Tags]]


class DropKeys(Message):
    """Forget ``keys`` of ``partition`` (unknown ones are ignored); returns ``KeysFound`` with
    the samples they named, which the caller then clears."""

    KIND = Kind.DROP_KEYS
    partition: str
    keys: list[str]


class ResetConsumption(Message):
    """Make every sample of ``partition`` that ``task`` (None: every task) consumed available
    to it again; leased samples stay leased. Answered with ``Ok``."""

    KIND = Kind.RESET_CONSUMPTION
    partition: str
    task: str | None = None


register(globals())

"""A unit's commits of one turn of its loop, in one message (protocol 8;
storage/_commit_queue.py sends them, controller/parts/_writes.py records them)."""

from __future__ import annotations

from ..errors import ProtocolError
from ._messages import Commit, Kind, Message, register

MAX_COMMITS = 1_024  # commits one Commits message may carry (a unit sends more as several)


class Commits(Message):
    """A unit's commits of one turn of its loop, in one message: entry ``i`` is the
    ``Commit`` of grant ``grant_ids[i]`` (``fields[i]``, ``nbytes[i]``,
    ``partition_bytes[i]``); ``unit_bytes`` is the unit's total when the message left.
    The controller records each as if it came alone, in order."""

    KIND = Kind.COMMITS
    unit_id: int
    grant_ids: list[int]
    fields: list[list[str]]
    nbytes: list[int]
    partition_bytes: list[int]
    unit_bytes: int

    def entries(self) -> list[Commit]:
        """Each entry as the ``Commit`` it stands for; ProtocolError where the lists
        disagree in length or there are more than ``MAX_COMMITS``."""
        n = len(self.grant_ids)
        if n > MAX_COMMITS:
            raise ProtocolError(f"a Commits message of {n} commits; at most {MAX_COMMITS}")
        if not len(self.fields) == len(self.nbytes) == len(self.partition_bytes) == n:
            raise ProtocolError(
                f"a Commits message lists {n} grants, {len(self.fields)} field lists, {len(self.nbytes)} "
                f"sizes and {len(self.partition_bytes)} partition sizes; they pair up one to one"
            )
        return [
            Commit(grant_id=g, unit_id=self.unit_id, fields=f, nbytes=b, partition_bytes=p, unit_bytes=self.unit_bytes)
            for g, f, b, p in zip(self.grant_ids, self.fields, self.nbytes, self.partition_bytes)
        ]


class CommitsDone(Message):
    """The answer to ``Commits``, entry by entry: ``sealed[i]`` as ``Committed.sealed``, and
    ``errors``, ``[i, code, message]`` for each entry that was refused (as an ``Error``
    would say it); the others were recorded."""

    KIND = Kind.COMMITS_DONE
    sealed: list[bool]
    errors: list[tuple[int, str, str]] = []


register(globals())

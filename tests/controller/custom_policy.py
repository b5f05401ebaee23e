"""A batch policy loaded into the controller by the tests (``--policy``)."""

import numpy as np


class NewestFirst:
    """The samples of the newest policy version first."""

    name = "newest_first"

    def select(self, candidates, count):
        ready = candidates.ready()
        if len(ready) < count:
            return None
        newest = np.argsort(-candidates.versions(ready), kind="stable")[:count]
        return np.sort(ready[newest])


class Greedy:
    """A broken policy: it takes samples that are not ready."""

    name = "greedy"

    def select(self, candidates, count):
        return np.arange(count) + 10_000


class Exploding:
    """A broken policy: it waits like ``first_ready``, then fails with a plain exception."""

    name = "exploding"

    def select(self, candidates, count):
        if len(candidates.ready()) < count:
            return None
        raise RuntimeError("exploding policy: a bug in the policy")


class Skip:
    """Reads its reader's arguments: the ready samples from position ``skip`` on (0 if
    not given), at most ``count``; waits while there are fewer."""

    name = "skip"

    def select(self, candidates, count):
        skip = int(candidates.args.get("skip", 0))
        ready = candidates.ready()[skip:]
        return ready[:count] if len(ready) >= count else None


class Slow:
    """Holds the controller's loop 10 ms at each call (a costly policy), then waits."""

    name = "slow"

    def select(self, candidates, count):
        import time

        time.sleep(0.01)  # the cost itself (the loop held), not a wait for anything
        return None

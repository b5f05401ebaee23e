"""A TransferQueue sampler of the user's own (a ``BaseSampler`` subclass given to ``init`` as
``controller.sampler``) as a tqueue batch policy, in the controller that ``init`` starts.

Nothing is pickled: the sampler's class travels as an import path (its module, or the file of
the script that defines it where that is ``__main__``) and its attributes as JSON; the
controller imports the class, makes it with no arguments and sets those attributes. The spec is
an ordinary tqueue policy spec, ``name=transfer_queue.sampler._policy:<attribute>``, the
attribute naming what to load (``__getattr__`` below), so the controller loads it as any other
named policy. A controller that is already running cannot be given one (the shim refuses it).

At each ``get_meta`` the policy calls ``sampler.sample(ready, batch_size, **sampling_config)``
with the ready indexes (a list) and the call's ``sampling_config`` (lists of numbers come back
as numpy arrays, as TransferQueue hands them over), and leases what it returns first. The
second list it returns (what TransferQueue marks consumed) is not used: the shim's fetch
consumes every sample it hands out.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import sys
from typing import Any

import numpy as np

PREFIX = "sampler_"


def spec(sampler: Any, name: str) -> str:
    """The policy spec that loads ``sampler`` (a class or an instance) in a controller;
    ``TypeError`` where its class cannot be imported there or its attributes are not JSON."""
    cls = sampler if isinstance(sampler, type) else type(sampler)
    module, file = cls.__module__, None
    if module == "__main__":
        file = getattr(sys.modules["__main__"], "__file__", None)
        if not file:
            raise TypeError(f"sampler {cls.__qualname__} is defined in an interactive session: define it in a module "
                            "or a script file, which the controller imports")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"sampler {cls.__qualname__} is defined inside a function: the controller cannot import it")
    state = {} if isinstance(sampler, type) else {k: v for k, v in vars(sampler).items() if k != "_states"}
    try:
        text = json.dumps({"module": module, "file": file, "qualname": cls.__qualname__, "state": state})
    except TypeError as exc:
        raise TypeError(f"sampler {cls.__qualname__}: its attributes travel to the controller as JSON ({exc})") from exc
    attribute = PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
    return f"{name}={__name__}:{attribute}"


def __getattr__(attribute: str) -> Any:
    if not attribute.startswith(PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
    raw = attribute[len(PREFIX):]
    described = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    return lambda: SamplerPolicy(described)


def _load_class(described: dict[str, Any]) -> type:
    if described["file"]:
        digest = hashlib.sha1(described["file"].encode()).hexdigest()[:12]
        name = f"_transfer_queue_sampler_{digest}"
        module = sys.modules.get(name)
        if module is None:
            found = importlib.util.spec_from_file_location(name, described["file"])
            if found is None or found.loader is None:
                raise ImportError(f"cannot import the sampler's script {described['file']}")
            module = importlib.util.module_from_spec(found)
            sys.modules[name] = module
            found.loader.exec_module(module)  # as an import: its __main__ block does not run
    else:
        module = importlib.import_module(described["module"])
    target: Any = module
    for part in described["qualname"].split("."):
        target = getattr(target, part)
    return target


def _arg(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return np.asarray(value)
    return value


class SamplerPolicy:
    """A tqueue policy that asks a TransferQueue sampler which ready samples to lease."""

    def __init__(self, described: dict[str, Any]) -> None:
        self.sampler = _load_class(described)()
        vars(self.sampler).update(described["state"])
        self.name = described["qualname"]

    def select(self, candidates: Any, count: int) -> np.ndarray | None:
        ready = candidates.ready()
        if len(ready) < count:
            return None  # the request waits (or, in polling mode, returns empty), as TransferQueue's
        args = {str(k): _arg(v) for k, v in candidates.args.items()}
        sampled, _consumed = self.sampler.sample([int(i) for i in ready], count, **args)
        chosen = np.asarray(list(sampled), dtype=np.int64)
        return np.unique(chosen) if len(chosen) else None

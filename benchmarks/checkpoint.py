"""Checkpoint figures: how fast a checkpoint is written and loaded, and how long it holds the
servers' loops as the number of samples grows.

    python benchmarks/checkpoint.py [--mib 1024] [--small 1000000] [--units 2] [--restore-units 3]

1. ``--mib`` of payload in 256 KiB samples is put on a cluster of ``--units`` units and
   checkpointed: payload GB/s (files fsynced) and the longest loop hold (``pause``).
2. ``--small`` more samples of 8 bytes (puts of 10,000) are added and checkpointed again: the
   pause with many samples, which is what grows with them.
3. The checkpoint is loaded into a fresh cluster of ``--restore-units`` units: GB/s, and a check
   that every big sample's first byte came back.
Prints one line per step and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import tqueue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--small", type=int, default=1_000_000)
    ap.add_argument("--units", type=int, default=2)
    ap.add_argument("--restore-units", type=int, default=3)
    args = ap.parse_args()
    out: dict[str, float] = {}
    big = args.mib * 4  # 256 KiB samples
    with tempfile.TemporaryDirectory(prefix="tqueue-ckpt-") as directory:
        with tqueue.LocalCluster(num_storage_units=args.units) as cluster, tqueue.Client(cluster.address) as c:
            for first in range(0, big, 64):
                n = min(64, big - first)
                x = torch.arange(first, first + n, dtype=torch.int64).remainder(251).to(torch.uint8)
                c.put("big", {"x": x[:, None].expand(n, 256 << 10).contiguous()})
            info = c.save_checkpoint(directory)
            out.update(save_gbps=info.payload_bytes / info.seconds / 1e9, save_s=info.seconds, big_pause_ms=1e3 * info.pause)
            print(f"save: {info.payload_bytes / 2**20:.0f} MiB, {info.samples} samples in {info.seconds:.2f} s "
                  f"({out['save_gbps']:.2f} GB/s); loops held {1e3 * info.controller_pause:.1f} ms (controller), "
                  f"{1e3 * info.unit_pause:.1f} ms (units)")
            for first in range(0, args.small, 10_000):
                n = min(10_000, args.small - first)
                c.put("small", {"y": torch.zeros(n, 2, dtype=torch.int32)})
            info = c.save_checkpoint(directory)
            out.update(small_samples=info.samples, small_pause_ms=1e3 * info.pause,
                       small_controller_ms=1e3 * info.controller_pause, small_unit_ms=1e3 * info.unit_pause)
            print(f"save with {info.samples} samples: {info.seconds:.2f} s; loops held {1e3 * info.controller_pause:.1f} ms "
                  f"(controller), {1e3 * info.unit_pause:.1f} ms (units)")
        with tqueue.LocalCluster(num_storage_units=args.restore_units) as cluster, tqueue.Client(cluster.address) as c:
            t0 = time.perf_counter()
            c.load_checkpoint(directory)
            seconds = time.perf_counter() - t0
            out.update(load_s=seconds, load_gbps=info.payload_bytes / seconds / 1e9)
            print(f"load into {args.restore_units} units: {info.payload_bytes / 2**20:.0f} MiB in {seconds:.2f} s "
                  f"({out['load_gbps']:.2f} GB/s)")
            meta = c.get_meta("big", ["x"], big, task="check", timeout=60)
            first_bytes = c.get_data(meta)["x"][:, 0]
            want = torch.tensor(meta.indexes, dtype=torch.int64).remainder(251).to(torch.uint8)
            assert torch.equal(first_bytes, want), "a sample did not come back"
    print(json.dumps(out))


if __name__ == "__main__":
    main()

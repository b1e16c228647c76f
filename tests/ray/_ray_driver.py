"""A second driver of the test cluster, run as its own process by the adapter tests.

Usage: ``python _ray_driver.py COMMAND ARGS...``; prints one JSON object on stdout.

* ``lookup ACTOR``: find the actor by name (no destination configured, so it is never
  created here); print its token and statistics.
* ``dump-and-leave DEST ACTOR COUNT``: create the actor (if needed) writing to DEST, make
  COUNT acknowledged dumps and disconnect at once, without flushing.
"""

from __future__ import annotations

import json
import os
import sys

import ray
import torch

import trajtrack.ray as tr


def main(command: str, *args: str) -> dict[str, object]:
    ray.init(address=os.environ["TRAJTRACK_TEST_RAY_ADDRESS"], log_to_driver=False)
    if command == "lookup":
        (name,) = args
        actor = tr.get_trajectory_tracker(name=name)
        info = ray.get(actor.ready.remote(), timeout=60)
        stats = ray.get(actor.statistics.remote(), timeout=60)
        return {"token": info["token"], "committed": stats.committed}
    if command == "dump-and-leave":
        dest, name, count = args
        os.environ.update(
            VERL_ENABLE_TRACKER="1", VERL_TRACKER_HDFS_DIR=dest, TRAJTRACK_RAY_ACTOR=name
        )
        info = ray.get(tr.get_trajectory_tracker(name=name).ready.remote(), timeout=60)
        for i in range(int(count)):  # 1 MB each, the last one right before disconnecting
            tr.dump_data({"late": torch.full((1 << 18,), float(i))}, f"late/{i}")
        return {"token": info["token"]}
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    result = main(*sys.argv[1:])
    print(json.dumps(result))
    sys.stdout.flush()
    ray.shutdown()

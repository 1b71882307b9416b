"""The trainer's publish step as a process of its own, for the fault tests (tests/test_sglang_faults.py to kill).

It does what training.trainer.Trainer.run does when `publish.due(step)`: export the draft to `Publisher.folder(step)`,
then `Publisher.publish(folder, step)` (journal, pruning and all). The draft is a random one shaped for the target,
seeded by the step (dspark_testkit.build_random_draft), so every step's draft matches the served one's shapes. Under
DSPARK_SGL_CRASH=publish_paused (dspark_sgl/faults.py) the process dies inside the publish, the server paused.

    python publish_step.py TARGET OUT_DIR URL STEP

Prints the publish results as one JSON line (the last) when it lives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_testkit import build_random_draft  # noqa: E402

from training.publish import PublishConfig, Publisher  # noqa: E402


def main(target: str, out_dir: str, url: str, step: str) -> None:
    publisher = Publisher(PublishConfig(every_steps=1, url=[url], timeout_s=120), Path(out_dir))
    folder = build_random_draft(Path(target), publisher.folder(int(step)), seed=int(step))
    print(json.dumps(publisher.publish(folder, int(step))), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

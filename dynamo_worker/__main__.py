"""`dualpace-dynamo` / `python -m dynamo_worker`: run DualPaceEngine under Dynamo's Worker."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from dynamo.common.backend.run import run
    except ImportError as exc:
        print(f"dualpace-dynamo: error: NVIDIA Dynamo is not installed ({exc}); install the extra: "
              "make venv, or see docs/scale-out.md", file=sys.stderr)
        return 2
    from dualpace.errors import DualPaceError
    from dynamo_worker.engine import DualPaceEngine

    try:
        run(DualPaceEngine, argv)
    except DualPaceError as exc:
        print(f"dualpace-dynamo: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

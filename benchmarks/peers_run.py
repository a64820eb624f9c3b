"""Run the peers' bench (``bench_peers.py`` of ../shared/peers, copied into the checkout)
with fp4moe bench's own timer, so both sides of a comparison are timed alike.

    python3 benchmarks/peers_run.py PEERS_DIR [bench_peers.py arguments]

``bench_peers.py`` keeps a copy of ``fp4moe.bench.GraphTimer``; this swaps in the real
one (each timed CUDA-graph replay behind a GPU wait longer than its submission, so the
events time the GPU's work alone) and runs its ``main``. Needs ``src`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys

from fp4moe import bench


def main(argv: list[str]) -> int:
    if not argv or not os.path.isfile(os.path.join(argv[0], "bench_peers.py")):
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.abspath(argv[0]))
    import bench_peers  # from the folder given

    bench_peers.GraphTimer = bench.GraphTimer
    return bench_peers.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

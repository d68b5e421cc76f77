"""infernix-pull: fetch a model alias into the cache ($INFERNIX_HOME, default ~/.cache/infernix)."""
from __future__ import annotations

import argparse
import sys

from infernix_jax import hub
from scripts._common import run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infernix-pull", description=__doc__)
    p.add_argument("alias", nargs="?", default=hub.DEFAULT_MODEL, choices=sorted(hub.ALIASES))

    def go():
        a = p.parse_args(argv)
        print(hub.pull(a.alias))

    return run("infernix-pull", go)


if __name__ == "__main__":
    sys.exit(main())

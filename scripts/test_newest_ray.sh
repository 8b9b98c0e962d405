#!/usr/bin/env bash
# The Ray tests against the newest Ray on PyPI (or RAYLM_RAY_VERSION), in a
# virtual environment of their own: constraints.txt's versions of everything
# else, raylm installed editable from this checkout. CI runs it after the main
# suite (README, "Set up"); the main suite covers the pinned Ray.
#
# It runs the tests that touch Ray's APIs (placement, actors, compiled graphs,
# the data-parallel replicas, Ray Serve), not the whole `ray` tier (33 minutes
# there): 28 tests, 6.5 minutes on a busy 2-core machine, plus the environment
# (about 5 minutes the first time, reused while the Ray version stays the same).
#
# Without RAYLM_RAY_VERSION it takes the newest Ray inside pyproject.toml's
# range; to try one past the range, set RAYLM_RAY_VERSION (the install then
# fails until the bound moves: on purpose).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RAYLM_NEWEST_RAY_VENV:-/tmp/raylm-newest-ray-venv}
if [[ -n "${RAYLM_RAY_VERSION:-}" ]]; then
  version=$RAYLM_RAY_VERSION
else
  # The newest release inside pyproject.toml's range: a Ray released after
  # the range was checked must not break CI; moving the bound is a decision
  # (run this with RAYLM_RAY_VERSION set to it first).
  version=$(pip index versions ray 2>/dev/null | python -c '
import re, sys, tomllib
from packaging.requirements import Requirement
from packaging.version import Version
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(Requirement(d).specifier for d in deps if Requirement(d).name == "ray")
lines = sys.stdin.read().splitlines()  # all of it: pip must not meet a closed pipe
line = next((l for l in lines if l.startswith("Available versions:")), "")
found = [Version(v) for v in re.findall(r"[0-9][^, ]*", line.split(":", 1)[-1])]
inside = [v for v in found if v in spec and not v.is_prerelease]
print(max(inside) if inside else "")')
  [[ -n "$version" ]] || { echo "cannot ask PyPI for Ray's versions; set RAYLM_RAY_VERSION" >&2; exit 2; }
fi

if [[ "$("$VENV/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null)" != "$version" ]]; then
  rm -rf "$VENV"
  python -m venv "$VENV"
  sed "s/^ray==.*/ray==$version/" constraints.txt > "$VENV/constraints.txt"
  "$VENV/bin/pip" install --quiet -e ".[test]" -c "$VENV/constraints.txt"
fi
echo "Ray tests against Ray $("$VENV/bin/python" -c 'import ray; print(ray.__version__)')"

# pytest's cache stays out of the checkout the main suite uses.
"$VENV/bin/python" -m pytest -m ray -p no:cacheprovider -q \
  tests/executor/test_ray_executor.py \
  tests/executor/test_ray_placement.py \
  tests/executor/test_ray_connect.py \
  tests/engine/test_data_parallel.py \
  tests/entrypoints/test_ray_serve.py \
  "$@"

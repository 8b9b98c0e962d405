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
# A Ray newer than pyproject.toml's range fails the install, on purpose: run
# this with RAYLM_RAY_VERSION set to it, and move the bound once it passes.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RAYLM_NEWEST_RAY_VENV:-/tmp/raylm-newest-ray-venv}
if [[ -n "${RAYLM_RAY_VERSION:-}" ]]; then
  version=$RAYLM_RAY_VERSION
else
  version=$(pip index versions ray 2>/dev/null | sed -n 's/^ray (\(.*\))$/\1/p')
  [[ -n "$version" ]] || { echo "cannot ask PyPI for Ray's newest version; set RAYLM_RAY_VERSION" >&2; exit 2; }
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

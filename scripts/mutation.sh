#!/usr/bin/env bash
# Mutation score of the data structures STYLE.md asks for: the radix cache, the hybrid radix
# cache and the expert residency table, with mutmut (PyPI; installed here on first use, kept
# out of the `dev` extra so the test install stays lean).
#
# Runs in a scratch copy (mutmut rewrites the sources it mutates), mutating only TARGETS and
# running only TESTS against each mutant (mutmut picks, per mutant, the tests that reach the
# mutated function). Prints one line per target: killed / total and the surviving mutants;
# docs/testing.md records the result and explains each survivor.
#   scripts/mutation.sh                        # the three targets, one worker
#   JOBS=2 TARGETS=freetoken/cache/radix.py TESTS=tests/cache scripts/mutation.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TARGETS=${TARGETS:-"freetoken/cache/radix.py freetoken/cache/hybrid.py freetoken/experts/residency.py"}
TESTS=${TESTS:-"tests/cache tests/experts/test_residency.py tests/experts/test_slot_cache.py"}
JOBS=${JOBS:-1}
WORK=${WORK:-$(mktemp -d /tmp/ft-mutation.XXXXXX)}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# 3.8.1 and later: earlier releases ship a top-level `tests` package that hides this repo's
python -c "import mutmut" 2>/dev/null || python -m pip install -q "mutmut>=3.8.1,<4"

mkdir -p "$WORK"
tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=mutants --exclude=__pycache__ \
    -cf - freetoken tests workloads harness_adapters pyproject.toml | tar -C "$WORK" -xf -
cd "$WORK"
# mutmut reads [mutmut] from setup.cfg (pyproject.toml has no [tool.mutmut] to shadow it)
{
    echo "[mutmut]"
    printf 'source_paths=\n    freetoken/\n'
    echo "only_mutate="
    for t in $TARGETS; do echo "    $t"; done
    echo "pytest_add_cli_args_test_selection="
    for t in $TESTS; do echo "    $t"; done
} >setup.cfg
# not `python -m mutmut`: the mutants import mutmut.__main__, which must be this same module
mutmut() { python -c "import sys; from mutmut.__main__ import cli; sys.exit(cli())" "$@"; }
mutmut run --max-children "$JOBS" >mutmut.log 2>&1 || { tail -40 mutmut.log; exit 1; }
mutmut results --all true >results.txt
python - "$TARGETS" <<'PY'
import sys
from collections import Counter

lines = [ln.strip() for ln in open("results.txt") if ": " in ln]
for target in sys.argv[1].split():
    mod = target.removesuffix(".py").replace("/", ".")
    rows = [ln.rsplit(": ", 1) for ln in lines if ln.startswith(mod + ".")]
    count = Counter(status for _, status in rows)
    killed, total = count["killed"], len(rows)
    score = 100.0 * killed / total if total else 0.0
    print(f"{target}: {killed}/{total} killed ({score:.1f}%)  "
          + " ".join(f"{k}={v}" for k, v in sorted(count.items()) if k != "killed"))
    for name, status in rows:
        if status != "killed":
            print(f"    {status:10s} {name}")
PY
echo "scratch copy (mutmut show NAME there): $WORK"

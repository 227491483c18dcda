#!/usr/bin/env bash
# Two trees' suites on the same test files, in the order A B B A, each run with a cold inductor cache of its own:
# a machine that drifts through the hour (the same tree's suite differs by up to ~15 % an hour apart) weighs on both
# trees alike. Each tree is a checkout set up by its own `make test` (run `make test ARGS=--collect-only` in it once).
# Usage: bash benchmarks/suite_abba.sh TREE_A TREE_B OUT_DIR tests/test_x.py [tests/test_y.py ...]
# Prints each run's pytest line and `TIME wall user system`; then `python benchmarks/suite_by_file.py` on the pairs.
set -uo pipefail
tree_a=$(realpath "$1") tree_b=$(realpath "$2") out=$(realpath -m "$3")
shift 3
mkdir -p "$out"
unset PYTHONDONTWRITEBYTECODE
i=0
for tree in "$tree_a" "$tree_b" "$tree_b" "$tree_a"; do
  i=$((i + 1))
  name="${i}_$(basename "$tree")"
  rm -rf "$out/inductor_$name"
  (cd "$tree" && TORCHINDUCTOR_CACHE_DIR="$out/inductor_$name" /usr/bin/time -f "TIME %e s %U u %S s" \
     make test ARGS="-v $*" 2>&1 |
   python3 -u -c "import sys,time; [print(f'{time.time():.0f} {l}', end='', flush=True) for l in sys.stdin]" \
     > "$out/$name.out")
  echo "$name: $(grep -E '(passed|failed).* in ' "$out/$name.out" | tail -1 | cut -d' ' -f2-)"
  echo "$name: $(grep '^[0-9]* TIME' "$out/$name.out" | cut -d' ' -f2-)"
done
here=$(dirname "$0")
python3 "$here/suite_by_file.py" "$out/1_$(basename "$tree_a").out" "$out/2_$(basename "$tree_b").out"
python3 "$here/suite_by_file.py" "$out/4_$(basename "$tree_a").out" "$out/3_$(basename "$tree_b").out"

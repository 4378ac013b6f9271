#!/usr/bin/env bash
# mypy over baton as it is imported: `baton.common`, `baton.services`, ... (pyproject's
# package-dir). The editable install maps those names to the repository's folders with an
# import hook, which mypy does not follow: checked by folder instead, every `baton.` import
# was unresolved and typed Any, so no call across modules was checked. A tree of links,
# .mypy_src/baton/<folder> -> <folder>, gives mypy the same map. Arguments go to mypy.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$root/.mypy_src/baton"
for folder in common services benchmarks lang; do
  ln -sfn "$root/$folder" "$root/.mypy_src/baton/$folder"
done
cd "$root"
exec mypy "$@"

#!/usr/bin/env bash
# Fetches the web page's third-party files (llmrun/ui/vendor/) from npm, exactly as pinned in
# llmrun/ui/vendor/VENDOR.md: each package's tarball by name@version, checked against the
# sha512 integrity recorded there, and from it only the ES module builds the page imports and
# the licence. The files are committed; this script is how they were made and how a changed
# pin is applied (edit VENDOR.md's table, run it, commit the result).
#   scripts/web-vendor.sh          re-fetch and overwrite
#   scripts/web-vendor.sh --check  re-fetch and fail if any committed file differs
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
vendor=$here/llmrun/ui/vendor
check=${1:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# the table rows of VENDOR.md: | package | version | integrity | into | files |
rows=$(grep -E '^\| `[^`]+` \|' "$vendor/VENDOR.md")
status=0
while IFS='|' read -r _ pkg version integrity into files _; do
  pkg=$(echo "$pkg" | tr -d ' `'); version=$(echo "$version" | tr -d ' `')
  integrity=$(echo "$integrity" | tr -d ' `'); into=$(echo "$into" | tr -d ' `')
  files=$(echo "$files" | tr -d '`')
  (cd "$work" && npm pack --silent "$pkg@$version" >/dev/null)
  tarball=$(ls "$work"/*.tgz)
  got="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
  if [ "$got" != "$integrity" ]; then
    echo "$pkg@$version: integrity $got, VENDOR.md pins $integrity" >&2
    exit 1
  fi
  mkdir -p "$work/x"
  tar xzf "$tarball" -C "$work/x"
  for f in $files; do  # package path, or package path=name in the vendor folder
    src=${f%%=*}; dst=${f#*=}; [ "$dst" != "$f" ] || dst=$(basename "$src")
    if [ "$check" = --check ]; then
      cmp -s "$work/x/package/$src" "$vendor/$into/$dst" \
        || { echo "differs from $pkg@$version's $src: $into/$dst" >&2; status=1; }
    else
      mkdir -p "$(dirname "$vendor/$into/$dst")"
      cp "$work/x/package/$src" "$vendor/$into/$dst"
    fi
  done
  rm -rf "$work/x" "$tarball"
  echo "$pkg@$version: ok"
done <<< "$rows"
exit $status

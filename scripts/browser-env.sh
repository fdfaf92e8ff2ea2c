#!/usr/bin/env bash
# A browser for the web page's tests (tests/integration/test_web.py): Debian's Chromium,
# driven by Playwright (the `test` extra) without Playwright's own browser download.
#
# Installed here when this runs as root with apt-get (as in CI), else named. It never fails
# `make test`: when there is no browser it says why, in the output and in .browser.why, which
# the tests' skip message repeats.
#   scripts/browser-env.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
WHY=$here/.browser.why
why() { echo "$*" > "$WHY"; echo "Browser tests: $*" >&2; exit 0; }

found() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
if ! found; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing for the browser tests: chromium"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }
  fi
  found || why "not run: they need Chromium (sudo apt-get install chromium), or" \
    "LLMRUN_TEST_CHROMIUM=/path/to/chrome"
fi
rm -f "$WHY"

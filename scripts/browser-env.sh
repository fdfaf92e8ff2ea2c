#!/usr/bin/env bash
# A browser for the web page's tests (tests/integration/test_web.py): Debian's Chromium,
# driven by Playwright (the `test` extra) without Playwright's own browser download.
#
# Installed here when this runs as root with apt-get (as in CI), else named. When there is no
# browser this says why, in the output and in .browser.why, and exits 0: `make test` goes on,
# and those tests then FAIL with that reason (tests/ci_groups.py), so the run is red but still
# reports the rest of the suite. LLMRUN_TEST_CHROMIUM=/path/to/chrome names another browser.
# On a machine that cannot have one, LLMRUN_TEST_SKIP=browser skips them on purpose (and this
# installs nothing).
#   scripts/browser-env.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
WHY=$here/.browser.why
why() {
  echo "$*" > "$WHY"
  echo "Browser tests: cannot run: $*" >&2
  echo "Browser tests: they will fail (skip them on purpose: LLMRUN_TEST_SKIP=browser)" >&2
  exit 0
}

skip=${LLMRUN_TEST_SKIP:-}
case ",${skip// /}," in
  *,browser,*) echo "Browser tests: skipped on purpose (LLMRUN_TEST_SKIP=$skip)"
               exit 0 ;;
esac

if [ -n "${LLMRUN_TEST_CHROMIUM:-}" ]; then  # named: that one, or none (never another)
  [ -f "$LLMRUN_TEST_CHROMIUM" ] && [ -x "$LLMRUN_TEST_CHROMIUM" ] \
    || why "LLMRUN_TEST_CHROMIUM=$LLMRUN_TEST_CHROMIUM is not an executable file"
  rm -f "$WHY"
  exit 0
fi
found() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
if ! found; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing for the browser tests: chromium"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }
    found || why "installing Chromium failed (apt-get install chromium, as root)"
  fi
  found || why "no Chromium: sudo apt-get install chromium, or LLMRUN_TEST_CHROMIUM=/path/to/chrome"
fi
rm -f "$WHY"

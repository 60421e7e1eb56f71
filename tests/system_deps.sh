#!/usr/bin/env bash
# What the test suite needs from the system, provided before any test runs (`make test` calls this):
# Java 17 for TorchServe's frontend, Chromium and its driver for the web page's browser test. With the
# argument "demo" (`make demo`, `make web`) only Java, which TorchServe needs to start at all.
# As root on Debian/Ubuntu it installs what is missing with apt-get; otherwise it names the packages
# and exits 1. SYSTEM_DEPS_DRY_RUN=1 prints the apt-get command instead of running it (for its test).
set -euo pipefail
for_what=${1:-test}
missing=()
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
if [ "$for_what" = test ] && { ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; }; then
  missing+=(chromium chromium-driver)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "make $for_what: installing ${missing[*]} (apt-get)" >&2
  if [ "${SYSTEM_DEPS_DRY_RUN:-}" = 1 ]; then
    echo "apt-get install -y -qq ${missing[*]}"
    exit 0
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  exit 0
fi
echo "make $for_what needs these Debian/Ubuntu packages first: ${missing[*]} (TorchServe runs on Java 17)" >&2
echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
exit 1

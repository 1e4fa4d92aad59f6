#!/usr/bin/env bash
# Reproduces worker/web/static/vendor/mqtt.min.js (and its licence) from the npm registry: the
# browser bundle that MQTT.js publishes in its package (dist/mqtt.min.js, with its bundled
# dependencies' licence comments at its end), unchanged. The chat page loads it from the
# worker's own static server, never from a CDN. To update: set VERSION, run with --update,
# check the page (tests/engine/test_web.py), commit the three changed files.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=5.16.0
# npm's integrity of the package tarball (npm view mqtt@$VERSION dist.integrity); npm pack
# checks the download against it.
INTEGRITY=sha512-G0VsEtuJz5sJUgZJaaADMVfW7SIFPzkIuHR+d6rk+tBeSwdCfd9BaIRycRfd2AbyFDEmLlFM+SDQeti/+IbOnw==
# sha256 of dist/mqtt.min.js in that tarball (tests/engine/test_web.py checks the vendored file against it).
BUNDLE_SHA256=f3cbeae580d3010048938ee370f2db0c15d16e6f7fc147cb32ae5510e571b387

dest=worker/web/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mqtt@$VERSION" >/dev/null)
tarball="$work/mqtt-$VERSION.tgz"
actual="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
if [ "$actual" != "$INTEGRITY" ] && [ "${1:-}" != "--update" ]; then
  echo "mqtt@$VERSION: tarball integrity $actual, expected $INTEGRITY" >&2
  exit 1
fi
tar -xzf "$tarball" -C "$work" package/dist/mqtt.min.js package/LICENSE.md
bundle_sha=$(sha256sum "$work/package/dist/mqtt.min.js" | cut -d' ' -f1)
if [ "$bundle_sha" != "$BUNDLE_SHA256" ] && [ "${1:-}" != "--update" ]; then
  echo "mqtt@$VERSION: dist/mqtt.min.js sha256 $bundle_sha, expected $BUNDLE_SHA256" >&2
  exit 1
fi
mkdir -p "$dest"
cp "$work/package/dist/mqtt.min.js" "$dest/mqtt.min.js"
cp "$work/package/LICENSE.md" "$dest/mqtt.LICENSE.md"
if [ "${1:-}" = "--update" ]; then
  echo "now set INTEGRITY=$actual and BUNDLE_SHA256=$bundle_sha in $0"
else
  echo "$dest/mqtt.min.js: MQTT.js $VERSION, sha256 $bundle_sha"
fi

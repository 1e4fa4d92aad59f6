#!/usr/bin/env bash
# Usage: bash scripts/bundle-redis.sh DEST
# Run on a Debian machine with redis-server installed (apt-get install -y redis-server). Copies
# redis-server and the shared libraries it needs beyond a base glibc (what `ldd` lists, less
# libc, libm and the loader) into DEST/bin and DEST/lib (~13 MB), for the GPU machine, which has
# no Redis and no network (the data-parallel benchmark's workers share a Redis store). There:
#   LD_LIBRARY_PATH=DEST/lib DEST/bin/redis-server --port 6379 --save ''
# The same approach as ../shared/device/bundle-mosquitto.
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
dest=$1
binary=$(command -v redis-server || echo /usr/bin/redis-server)
[ -x "$binary" ] || { echo "no redis-server here: apt-get install -y redis-server" >&2; exit 1; }
rm -rf "$dest"; mkdir -p "$dest/bin" "$dest/lib"
# Debian's redis-server is a link to redis-check-rdb: the one binary picks its role by the name
# it runs under, so the copy (the link followed) must be named redis-server.
cp -L "$binary" "$dest/bin/redis-server"
ldd "$binary" | awk '/=>/ {print $3}' | sort -u \
  | grep -vE 'libc\.so|libm\.so|ld-linux' | xargs -I{} cp -L {} "$dest/lib/"
LD_LIBRARY_PATH="$dest/lib" "$dest/bin/redis-server" --version
echo "bundle in $dest: $(du -sh "$dest" | cut -f1)"

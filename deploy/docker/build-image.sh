#!/usr/bin/env bash
# Builds the tandem image of one variant with buildah, from a wheelhouse, with no package index inside the build:
#
#   deploy/docker/build-image.sh cpu|cuda [BASE]
#
# 1. the variant's wheelhouse (deploy/wheelhouse.py build --runtime-only) into .image/wheelhouse-VARIANT, for the
#    base's CPython 3.11 and glibc 2.36 (bookworm);
# 2. the base: BASE, an image the builder can pull (default python:3.11.14-slim-bookworm), or `debootstrap`: Debian
#    bookworm with python3 and python3-venv made by Debian's debootstrap from Debian's archive (for machines that
#    reach no image registry), imported once as localhost/tandem-base:bookworm;
# 3. `buildah bud` of deploy/docker/Dockerfile, tagged localhost/tandem:VERSION-VARIANT, then its size.
#
# buildah runs rootless-style here: vfs storage (no overlay mounts) and chroot isolation (no user namespaces), which
# is what works inside an unprivileged container; on a normal host drop BUILDAH_FLAGS/ISOLATION for the defaults.
# Needs buildah (and debootstrap for BASE=debootstrap): installed with apt-get when missing and running as root.
set -euo pipefail
cd "$(dirname "$0")/../.."

VARIANT=${1:?usage: build-image.sh cpu|cuda [BASE]}
BASE=${2:-python:3.11.14-slim-bookworm}
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
TAG=localhost/tandem:$VERSION-$VARIANT
BUILDAH_FLAGS=(${BUILDAH_FLAGS:---storage-driver vfs})
ISOLATION=${ISOLATION:-chroot}
case $VARIANT in cpu) MODEL=() ;; cuda) MODEL=(--no-model) ;; *) echo "VARIANT is cpu or cuda" >&2; exit 2 ;; esac

step() { printf '\n[image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
need() {
    command -v "$1" > /dev/null && return
    [ "$(id -u)" = 0 ] || { echo "$1 is missing: apt-get install $1" >&2; exit 2; }
    step "installing $1 (Debian's package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" > /dev/null
}
started=$(date +%s)
need buildah

step "wheelhouse for $VARIANT (runtime only) into .image/wheelhouse-$VARIANT"
"$PYTHON" deploy/wheelhouse.py build --out ".image/wheelhouse-$VARIANT" --python 3.11 \
    --platform manylinux_2_36_x86_64 --torch "$VARIANT" --runtime-only "${MODEL[@]}"

if [ "$BASE" = debootstrap ]; then
    BASE=localhost/tandem-base:bookworm
    if ! buildah "${BUILDAH_FLAGS[@]}" inspect --type image "$BASE" > /dev/null 2>&1; then
        need debootstrap
        step "debootstrap: Debian bookworm with python3 into .image/rootfs"
        rm -rf .image/rootfs && mkdir -p .image
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm .image/rootfs \
            > .image/debootstrap.log
        rm -rf .image/rootfs/var/cache/apt/archives/*.deb .image/rootfs/var/lib/apt/lists/*
        tar -C .image/rootfs -cf .image/rootfs.tar .
        step "importing it as $BASE"
        container=$(buildah "${BUILDAH_FLAGS[@]}" from scratch)
        buildah "${BUILDAH_FLAGS[@]}" add "$container" .image/rootfs.tar / > /dev/null
        buildah "${BUILDAH_FLAGS[@]}" config --cmd /bin/bash "$container"
        buildah "${BUILDAH_FLAGS[@]}" commit --quiet "$container" "$BASE" > /dev/null
        buildah "${BUILDAH_FLAGS[@]}" rm "$container" > /dev/null
        rm -rf .image/rootfs .image/rootfs.tar
    fi
fi

step "buildah bud $TAG (base $BASE)"
buildah "${BUILDAH_FLAGS[@]}" bud --isolation "$ISOLATION" -f deploy/docker/Dockerfile \
    --build-arg VARIANT="$VARIANT" --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" \
    --build-arg REVISION="$(git rev-parse HEAD 2> /dev/null || echo unknown)" -t "$TAG" .

size=$(buildah "${BUILDAH_FLAGS[@]}" images --format '{{.Size}}' "$TAG")
step "built $TAG: $size in $(( $(date +%s) - started )) s"
echo "{\"image\": \"$TAG\", \"base\": \"$BASE\", \"size\": \"$size\", \"seconds\": $(( $(date +%s) - started ))}"

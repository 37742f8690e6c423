#!/usr/bin/env bash
# kvrecall.sh — set up, build and run kvrecall from a fresh clone in one step.
#
#   ./kvrecall.sh demo    install what the demo needs, build the library and the
#                         `kvrecall` command only (release, in build-demo; no
#                         tests, no CUDA backend, no Python package),
#                         fetch the model, run the main job: SmolLM2-135M answers
#                         a question about the GPL-3 (7.7K tokens of context)
#                         with freekv retrieval (B = 1024) on the CPU backend,
#                         sampling as the model's card recommends, seed 42;
#                         extra arguments go to `kvrecall generate` (e.g.
#                         --mode dense --max-tokens 100)
#   ./kvrecall.sh longgen after the demo's set-up, the long-generation demo:
#                         SmolLM2 writes 8,000 tokens from a short prompt, densely
#                         and with freekv (B = 1024), and prints decode tokens/s,
#                         corrections and resident memory against position; the
#                         record (JSON) and its plot (SVG) go to the cache
#                         (~/.cache/kvrecall/longgen.*); extra arguments go to
#                         `kvrecall generate` (e.g. --max-tokens 2000)
#   ./kvrecall.sh test    install what is missing (the test packages too, and a
#                         Python virtual environment holding torch and
#                         transformers for the transformers backend's tests),
#                         build everything, run every test suite (C and Python)
#   ./kvrecall.sh deps    install the Debian packages of the demo and the tests
#   ./kvrecall.sh build   configure and build only
#
# Environment: BUILD_DIR (default build; the demo's is DEMO_BUILD_DIR,
# default build-demo), MESON_ARGS (extra `meson setup` options, e.g.
# "-Dcuda=disabled" or "-Db_sanitize=address,undefined -Db_lundef=false"),
# CI=true adds -Dwerror=true.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"
BUILD_DIR=${BUILD_DIR:-build}
MESON_ARGS=${MESON_ARGS:-}

# nvcc lives outside PATH on a stock CUDA install; the CUDA backend is compiled
# whenever it is found.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
	export PATH="/usr/local/cuda/bin:$PATH"
fi

# Debian packages. The demo needs only what builds the library and the
# command and fetches the model (python3-pip: fetch_model.sh; base-files: the
# GPL-3 text the demo reads); the tests add Criterion, C++ (cudaemu), Python's
# headers and test modules, PCRE2 (the pre-tokenizer benchmark) and the
# command-line tools of hwloc and numactl.
demo_packages=(gcc meson ninja-build pkg-config libhwloc-dev liburing-dev libnuma-dev
	python3 python3-pip base-files)
test_packages=(g++ libcriterion-dev hwloc-nox numactl python3-dev python3-venv
	python3-numpy python3-pytest libpcre2-dev)

# The transformers backend's tests run in a virtual environment of their own
# (Debian's python3 refuses pip outside one): torch and transformers from
# PyPI, about 3 GB the first time (two minutes here), then pip's cache and a
# stamp of what was installed keep later runs fast. KVRECALL_VENV moves it;
# KVRECALL_VENV=none skips it (those tests then skip, saying why).
venv_packages=(numpy pytest torch 'transformers>=5.0,<6' 'accelerate>=1.0' 'gguf>=0.10')

# Install whichever of the given Debian packages are missing.
deps() {
	local missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
			missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	local sudo=()
	[ "$(id -u)" -eq 0 ] || sudo=(sudo)
	echo "kvrecall.sh: installing ${missing[*]}" >&2
	"${sudo[@]}" apt-get update -q
	DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
		"${missing[@]}"
}

python_venv() {
	[ "${KVRECALL_VENV:-}" = none ] && return 0
	local venv=${KVRECALL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall/venv}
	local stamp="$venv/.kvrecall-packages" want="${venv_packages[*]}"
	if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
		return 0
	fi
	echo "kvrecall.sh: preparing $venv (${venv_packages[*]})" >&2
	/usr/bin/python3 -m venv "$venv"
	"$venv/bin/pip" install -q --disable-pip-version-check "${venv_packages[@]}"
	echo "$want" >"$stamp"
}

build() {
	local args=()
	[ "${CI:-}" = true ] && args+=(-Dwerror=true)
	# shellcheck disable=SC2206 # MESON_ARGS is a list of options on purpose
	args+=($MESON_ARGS)
	if [ -f "$BUILD_DIR/build.ninja" ]; then
		meson setup --reconfigure "$BUILD_DIR" "${args[@]}" >/dev/null
	else
		meson setup "$BUILD_DIR" "${args[@]}"
	fi
	ninja -C "$BUILD_DIR"
}

# The demo's build: what the first command needs and nothing more, so a new
# user waits for the library and one program, not for every test suite. The
# runner drives the cpu backend, so neither the CUDA backend nor the Python
# package is compiled.
demo_build() {
	local dir=${DEMO_BUILD_DIR:-build-demo}
	local args=(-Dbuildtype=release -Dtests=disabled -Dfuzz=disabled -Dcuda=disabled -Dpython=disabled)
	# shellcheck disable=SC2206 # MESON_ARGS is a list of options on purpose
	args+=($MESON_ARGS)
	if [ -f "$dir/build.ninja" ]; then
		meson setup --reconfigure "$dir" "${args[@]}" >/dev/null
	else
		meson setup "$dir" "${args[@]}" >/dev/null
	fi
	ninja -C "$dir" bench/kvrecall
	KVRECALL="$dir/bench/kvrecall"
}

# the comment block at the top of this file
usage() {
	awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

cmd=${1:-}
shift || true
case "$cmd" in
deps) deps "${demo_packages[@]}" "${test_packages[@]}" ;;
build) deps "${demo_packages[@]}" "${test_packages[@]}" && build ;;
test)
	deps "${demo_packages[@]}" "${test_packages[@]}"
	python_venv
	build
	meson test -C "$BUILD_DIR" -v --print-errorlogs "$@"
	;;
demo)
	deps "${demo_packages[@]}"
	demo_build
	bench/model/fetch_model.sh >/dev/null
	"$KVRECALL" info
	echo
	# The answer sits in section 8, about 4,800 tokens into the document, far
	# outside the sink and window: only page selection reaches it. Sampling is
	# what the model's card recommends (temperature 0.2, top-p 0.9), with a
	# fixed seed so every run prints the same answer; greedy decoding of this
	# 135M model repeats itself.
	"$KVRECALL" generate --file /usr/share/common-licenses/GPL-3 \
		--question "How many days after receiving notice of a violation does a licensee have to cure it?" \
		--mode freekv --budget 1024 --max-tokens 300 --temperature 0.2 --top-p 0.9 --seed 42 "$@"
	;;
longgen)
	deps "${demo_packages[@]}"
	demo_build
	bench/model/fetch_model.sh >/dev/null
	out=${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall/longgen
	"$KVRECALL" generate --chat "Tell me a very long story about a lighthouse keeper who finds a map." \
		--max-tokens 8000 --ignore-eos --compare dense,freekv --budget 1024 --timeline 500 \
		--json "$out.json" "$@"
	python3 bench/plots/plot_longgen.py "$out.json" "$out.svg"
	echo "record: $out.json; plot: $out.svg"
	;;
-h | --help | help) usage ;;
*)
	[ -n "$cmd" ] && echo "kvrecall.sh: unknown command '$cmd'" >&2
	usage >&2
	exit 2
	;;
esac

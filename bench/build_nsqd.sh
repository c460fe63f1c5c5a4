#!/usr/bin/env bash
# Build nsqd (nsqio/nsq v1.2.1) from local git repositories with Debian's Go 1.19, offline,
# for bench/nsq.py --nsqd PATH. Nothing of nsq is kept in this repository: the sources are
# read from clones you made (one per repository in the table below) and the build happens
# in a work directory outside it.
#
#   bash bench/build_nsqd.sh --repos DIR --work DIR
#
#   --repos DIR  holds one git repository (a clone, bare or not) per row of the table, as
#                DIR/<owner>+<name>/repo or DIR/<owner>+<name> (e.g. DIR/nsqio+nsq/repo)
#   --work DIR   where the sources are unpacked and nsqd is built (default /tmp/nsqd-build);
#                prints the binary's path, DIR/nsqd, as its last line
#
# How: `git archive` unpacks each repository at the revision nsq v1.2.1's go.mod and go.sum
# name; nsq's go.mod gets a `replace` to the local directory for every module of its
# module graph (go 1.16 modules: the whole graph is loaded, so the test-only ones too);
# a module that has no go.mod at that revision (the proxy synthesises one for those) gets
# a one-line one; then `go build` with GOFLAGS=-mod=mod GOPROXY=off, so nothing is
# downloaded. Needs git, tar and go (deploy/setup.sh --bench installs golang-go).
set -Eeuo pipefail
trap 'echo "bench/build_nsqd.sh: failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

repos="" work="/tmp/nsqd-build"
while [ $# -gt 0 ]; do
    case "$1" in
        --repos) repos="$2"; shift 2 ;;
        --work) work="$2"; shift 2 ;;
        -h|--help) sed -n 2,20p "$0"; exit 0 ;;
        *) echo "bench/build_nsqd.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -n "$repos" ] || { echo "bench/build_nsqd.sh: --repos DIR is required (see --help)" >&2; exit 2; }
command -v go >/dev/null || { echo "bench/build_nsqd.sh: no go; bash deploy/setup.sh --bench installs golang-go" >&2; exit 1; }

# module path                        repository                 revision (from nsq v1.2.1's go.mod/go.sum)
modules="
github.com/nsqio/nsq                 nsqio/nsq                  v1.2.1
github.com/BurntSushi/toml           BurntSushi/toml            v0.3.1
github.com/bitly/go-hostpool         bitly/go-hostpool          v0.1.0
github.com/bitly/timer_metrics       bitly/timer_metrics        v1.0.0
github.com/blang/semver              blang/semver               v3.5.1
github.com/bmizerany/perks           bmizerany/perks            d9a9656a3a4b
github.com/davecgh/go-spew           davecgh/go-spew            v1.1.1
github.com/golang/snappy             golang/snappy              v0.0.1
github.com/judwhite/go-svc           mreiferson/go-svc          7a96e00010f6
github.com/julienschmidt/httprouter  julienschmidt/httprouter   v1.3.0
github.com/mreiferson/go-options     mreiferson/go-options      v1.0.0
github.com/nsqio/go-diskqueue        nsqio/go-diskqueue         v1.0.0
github.com/nsqio/go-nsq              nsqio/go-nsq               v1.0.8
golang.org/x/sys                     golang/sys                 22da62e12c0c
github.com/stretchr/testify          stretchr/testify           v1.4.0
github.com/pmezard/go-difflib        pmezard/go-difflib         v1.0.0
github.com/stretchr/objx             stretchr/objx              v0.1.0
gopkg.in/yaml.v2                     go-yaml/yaml               v2.2.2
gopkg.in/check.v1                    go-check/check             20d25e280405
"

git_dir() {  # the clone of owner/name under --repos
    local slug="${1/\//+}"
    for d in "$repos/$slug/repo" "$repos/$slug"; do
        if git -C "$d" rev-parse --git-dir >/dev/null 2>&1; then echo "$d"; return; fi
    done
    echo "bench/build_nsqd.sh: no git repository for $1 in $repos/$slug (or $repos/$slug/repo)" >&2
    return 1
}

rm -rf "$work/src"
mkdir -p "$work/src"
replaces=()
while read -r module repo rev; do
    [ -n "$module" ] || continue
    dir="$work/src/${repo/\//+}"
    mkdir -p "$dir"
    src="$(git_dir "$repo")"
    git -C "$src" archive "$rev" | tar -x -C "$dir"
    [ -f "$dir/go.mod" ] || echo "module $module" > "$dir/go.mod"
    [ "$module" = "github.com/nsqio/nsq" ] || replaces+=("-replace=$module=$dir")
done <<< "$modules"

nsq="$work/src/nsqio+nsq"
export GOFLAGS=-mod=mod GOPROXY=off GOSUMDB=off GOPATH="$work/gopath" GOCACHE="$work/gocache" CGO_ENABLED=0
(cd "$nsq" && go mod edit "${replaces[@]}" && go build -o "$work/nsqd" ./apps/nsqd)
"$work/nsqd" --version >&2
echo "$work/nsqd"

#!/usr/bin/env bash
# Stops a registry started by hack/start-registry.sh.
#
# Usage: hack/stop-registry.sh (--port N | --dir DIR) [--purge]
#
#   --port N   the port it was started with (its state is /var/tmp/minicri-registry-N)
#   --dir DIR  the state directory it was started with
#   --purge    also delete the state directory (config, storage, log)
#
# Succeeds when no registry of that directory is running afterwards, also when none was.
set -euo pipefail

dir=
purge=false

usage() {
    # The header comment, minus the '#'.
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --port) dir=/var/tmp/minicri-registry-${2:?--port needs a value}; shift 2 ;;
        --port=*) dir=/var/tmp/minicri-registry-${1#*=}; shift ;;
        --dir) dir=${2:?--dir needs a value}; shift 2 ;;
        --dir=*) dir=${1#*=}; shift ;;
        --purge) purge=true; shift ;;
        -h|--help) usage 0 ;;
        *) echo "stop-registry: unknown argument: $1" >&2; usage 2 >&2 ;;
    esac
done

if [[ -z $dir ]]; then
    echo "stop-registry: give --port N or --dir DIR" >&2
    usage 2 >&2
fi
if [[ ! -d $dir ]]; then
    echo "stop-registry: $dir does not exist; nothing to stop"
    exit 0
fi
dir=$(cd "$dir" && pwd)
pidfile=$dir/registry.pid

if [[ -f $pidfile ]]; then
    pid=$(<"$pidfile")
    # Only signal the process if it is the docker-registry serving this directory's config.
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null \
        && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir/config.yml"; then
        kill -TERM "$pid"
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "stop-registry: pid $pid ignored SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "stop-registry: stopped pid $pid ($dir)"
    else
        echo "stop-registry: no running registry for $dir"
    fi
    rm -f "$pidfile"
else
    echo "stop-registry: no pid file in $dir; nothing to stop"
fi

if $purge; then
    rm -rf "$dir"
    echo "stop-registry: removed $dir"
fi
